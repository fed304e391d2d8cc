"""One token rule, one room: outside ``stapo_trl/core/token_rules/``, no module names a rule, its switch, its fields or its
metrics; they iterate over the registry instead. Prose (docstrings, help text, messages) may mention a rule."""

import ast
from pathlib import Path

import stapo_trl
from stapo_trl.core.token_rules import TOKEN_RULES, switched_rules

PACKAGE = Path(stapo_trl.__file__).parent
RULES_PACKAGE = PACKAGE / "core" / "token_rules"


def rule_words() -> set[str]:
    """Every identifier that belongs to one rule: its name, its switch and its config fields."""
    words = set(TOKEN_RULES)
    for spec in switched_rules():
        words |= {spec.switch, *spec.fields}
    return words


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def rule_references(path: Path, words: set[str], rule_names: set[str], root: Path = PACKAGE.parent) -> list[str]:
    """Where a module's code names a rule: an attribute or name spelled like a rule word, a keyword argument with
    one, a string that is one, a metric string ``<rule>/...``, or a constant named after a rule (``S2T_...``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    prefixes = tuple(f"{name.upper()}_" for name in rule_names)
    found = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Attribute) and node.attr in words:
            hit = f".{node.attr}"
        elif isinstance(node, ast.keyword) and node.arg in words:
            hit = f"{node.arg}="
        elif isinstance(node, ast.Name) and (node.id in words or node.id.startswith(prefixes)):
            hit = node.id
        elif isinstance(node, ast.alias) and (node.asname or node.name).split(".")[-1].startswith(prefixes):
            hit = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            value = node.value
            if value in words or any(value.startswith(f"{name}/") for name in rule_names):
                hit = repr(value)
        if hit is not None:
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}: {hit}")
    return found


def references_outside_the_rules(package: Path = PACKAGE, words=None, rule_names=None) -> list[str]:
    words = rule_words() if words is None else words
    rule_names = set(TOKEN_RULES) if rule_names is None else rule_names
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "core" / "token_rules") or path.is_relative_to(package / "token_rules"):
            continue
        found += rule_references(path, words, rule_names, package.parent)
    return found


BRIDGES = ("stapo_trl/verl/losses.py", "stapo_trl/research/counterfactual/arms.py")
"""Modules that must name a rule: the verl plugin registers verl losses called ``stapo`` and ``stare`` that call the
rules' pure functions with their own keyword arguments, and the counterfactual study's arms are variants of S2T's
selection, named after it. Only these modules are exempt; the rest of their packages is scanned."""


def test_no_module_outside_token_rules_names_a_rule():
    assert [hit for hit in references_outside_the_rules() if not hit.startswith(BRIDGES)] == []


def test_the_scan_finds_each_way_of_naming_a_rule(tmp_path):
    package = tmp_path / "stapo_trl"
    (package / "token_rules").mkdir(parents=True)
    (package / "token_rules" / "s2t.py").write_text('SWITCH = "use_s2t_mask"\n')
    (package / "trainer.py").write_text(
        '"""The S2T mask is named here in prose, which is fine."""\n'
        "from .token_rules.s2t import S2T_NUM_SILENCED\n"
        "def params(config):\n"
        '    """use_s2t_mask in a docstring is prose."""\n'
        "    if config.use_s2t_mask:\n"
        '        return {"prob_threshold": config.prob_threshold, "name": "s2t", "key": "s2t/num_silenced"}\n'
        "    return dict(entropy_quantile=0.8)\n"
    )
    found = references_outside_the_rules(
        package, words={"s2t", "use_s2t_mask", "prob_threshold", "entropy_quantile"}, rule_names={"s2t"}
    )
    assert sorted(hit.split(": ")[1] for hit in found) == sorted(
        [
            "S2T_NUM_SILENCED",
            ".use_s2t_mask",
            "'prob_threshold'",
            ".prob_threshold",
            "'s2t'",
            "'s2t/num_silenced'",
            "entropy_quantile=",
        ]
    )


def test_every_module_in_the_rules_package_is_imported_so_its_rule_registers():
    """The rules package imports each of its modules, so importing it registers every built-in rule."""
    import importlib
    import pkgutil
    import sys

    for module in pkgutil.iter_modules([str(RULES_PACKAGE)]):
        assert f"stapo_trl.core.token_rules.{module.name}" in sys.modules
    assert {"s2t", "stare", "random_silencing"} <= set(TOKEN_RULES)
    assert (
        importlib.import_module("stapo_trl.core.token_rules.random_silencing").RandomSilencingRule.name in TOKEN_RULES
    )
