"""The TRL boundary's drift checks (`stapo_trl.trl_boundary.drift_checks`): each seam fits the installed TRL, each
check can fail, and no module outside `stapo_trl.trl_boundary` and the core's `stapo_trl.core.trl_seams` names a TRL or
transformers private.
"""

import ast
import inspect
from pathlib import Path

import pytest
import transformers
import trl
from trl import GRPOTrainer

import stapo_trl
from stapo_trl import trl_boundary
from stapo_trl.trl_boundary.drift_checks import SEAMS, TESTED_TRL

PACKAGE = Path(stapo_trl.__file__).parent
BOUNDARY = Path(trl_boundary.__file__).parent
CORE_SEAMS = BOUNDARY.parent / "core" / "trl_seams.py"
TRANSFORMERS_MODULES = (
    "trainer.py",
    "trainer_callback.py",
    "trainer_utils.py",
    "training_args.py",
    "configuration_utils.py",
    "modeling_utils.py",
    "generation/utils.py",
)
FOREIGN_PACKAGES = ("trl", "transformers", "accelerate", "peft")


@pytest.mark.parametrize(
    "seam",
    [pytest.param(seam, marks=pytest.mark.vllm) if seam.requires == "vllm" else seam for seam in SEAMS],
    ids=lambda seam: seam.name,
)
def test_seam_fits_the_installed_trl(seam):
    if not seam.can_check():
        pytest.skip(f"{seam.requires} is not installed; this seam is checked in the vLLM environment of .ci/run")
    problems = seam.check()
    assert not problems, (
        f"seam {seam.name!r} no longer fits TRL {trl.__version__} (stapo-trl is tested with {TESTED_TRL}.x): "
        + "; ".join(problems)
        + f". stapo-trl relies on this in TRL 1.16: {seam.relies_on}"
    )


def test_every_seam_is_documented():
    for seam in SEAMS:
        assert seam.relies_on.strip(), seam.name
    assert len({seam.name for seam in SEAMS}) == len(SEAMS)


@pytest.mark.parametrize(
    ("seam_name", "target", "old", "new"),
    [
        ("per_token_logps_and_entropies", "_get_per_token_logps_and_entropies", "return logps, entropies", "return 1"),
        ("generate_and_score_completions", "_generate_and_score_completions", '"num_items_in_batch"', '"n_items"'),
        ("generate_single_turn", "_generate_single_turn", "return completion_ids, logprobs", "return ids"),
        ("on_optimizer_step_start", "_prepare_inputs", "self._buffered_inputs = [", "self._buffer = ["),
        ("log_metric", "__init__", 'self._metrics = {"train": defaultdict(list)', "self._logs = {}"),
    ],
)
def test_a_seam_check_fails_when_trl_changes_shape(seam_name, target, old, new, monkeypatch):
    """Each check reads TRL's source; with one expected line changed, the seam reports it."""
    seam = next(seam for seam in SEAMS if seam.name == seam_name)
    real_getsource = inspect.getsource
    original = inspect.unwrap(getattr(GRPOTrainer, target))

    def getsource(obj):
        source = real_getsource(obj)
        return source.replace(old, new) if inspect.unwrap(obj) is original else source

    monkeypatch.setattr(inspect, "getsource", getsource)
    assert seam.check(), f"{seam_name} did not notice {old!r} going away"


@pytest.mark.parametrize(
    ("seam_name", "target", "old", "new"),
    [
        ("colocated vLLM on CPU: weight sync", "sync_weights", "model_runner.model.load_weights([(name, param)])", ""),
        ("colocated vLLM on CPU: engine construction", "_init_vllm", "self.llm = LLM(", "self.llm = Engine("),
        ("colocated vLLM on CPU: engine construction", "_init_vllm", "max_num_batched_tokens=4096,", "dtype=x,"),
    ],
)
def test_a_vllm_seam_check_fails_when_trl_changes_shape(seam_name, target, old, new, monkeypatch):
    """The colocate seams read TRL's VLLMGeneration; with one expected line changed (or a keyword the CPU adapter adds
    itself appearing in TRL's own LLM call), the seam reports it."""
    from trl.generation.vllm_generation import VLLMGeneration

    seam = next(seam for seam in SEAMS if seam.name == seam_name)
    assert seam.check() == []
    real_getsource = inspect.getsource
    original = inspect.unwrap(getattr(VLLMGeneration, target))

    def getsource(obj):
        source = real_getsource(obj)
        return source.replace(old, new) if inspect.unwrap(obj) is original else source

    monkeypatch.setattr(inspect, "getsource", getsource)
    assert seam.check(), f"{seam_name} did not notice {old!r} becoming {new!r}"


def test_a_seam_check_fails_when_a_signature_changes(monkeypatch):
    def save_model(self, output_dir=None):
        return None

    monkeypatch.setattr(transformers.Trainer, "save_model", save_model)
    seam = next(seam for seam in SEAMS if seam.name == "save_model_without_push")
    assert any("_internal_call" in problem for problem in seam.check())


# --- no private outside the seam ------------------------------------------------------------------------------------


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def _names_defined_in(tree: ast.AST) -> set[str]:
    """Private names a source defines: functions, classes, ``self.x =`` attributes, parameters, assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if _private(name)}


def foreign_private_names() -> set[str]:
    """Every private name TRL defines anywhere, and transformers defines in its trainer, config and model base."""
    transformers_root = Path(transformers.__file__).parent
    files = [*Path(trl.__file__).parent.rglob("*.py"), *(transformers_root / name for name in TRANSFORMERS_MODULES)]
    names = set()
    for path in files:
        names |= _names_defined_in(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _foreign_bases(tree: ast.Module) -> set[str]:
    """Names a module imports from TRL, transformers, accelerate or peft (or the TRL boundary), so classes built on
    them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in FOREIGN_PACKAGES or {"trl_boundary", "trl_seams"} & set(node.module.split(".")):
                names |= {alias.asname or alias.name for alias in node.names}
    return names


def _own_private_names(files: list[Path]) -> set[str]:
    """Private names the package defines for itself, outside any class derived from a TRL or transformers class (an
    attribute counts only when set on ``self`` or ``cls``: setting one on a transformers object is a touch)."""
    own = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        foreign = _foreign_bases(tree)
        derived = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and any(isinstance(base, ast.Name) and base.id in foreign for base in node.bases)
        ]
        inside_derived = {id(child) for cls in derived for child in ast.walk(cls)}
        for node in ast.walk(tree):
            if id(node) in inside_derived:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                own.add(node.id)
    return own


def private_touches(path: Path, foreign: set[str]) -> list[str]:
    """Where a module names one of ``foreign``: attribute access, keyword argument, method override or class attribute
    in a class built on TRL or transformers, or an import of a private name or module of those packages."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in foreign:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in foreign:
            found.append(f"{path.name}:{node.lineno} {node.arg}=")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN_PACKAGES:
            parts = node.module.split(".")
            private = [alias.name for alias in node.names if _private(alias.name)]
            if private or any(_private(part) for part in parts):
                found.append(f"{path.name}:{node.lineno} from {node.module} import {', '.join(private) or '...'}")
    bases = _foreign_bases(tree)
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        if not any(isinstance(base, ast.Name) and base.id in bases for base in cls.bases):
            continue
        for statement in cls.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name in foreign:
                found.append(f"{path.name}:{statement.lineno} overrides {cls.name}.{statement.name}")
            targets = statement.targets if isinstance(statement, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id in foreign:
                    found.append(f"{path.name}:{statement.lineno} sets {cls.name}.{target.id}")
    return found


def test_no_trl_or_transformers_private_name_outside_the_boundary():
    files = sorted(path for path in PACKAGE.rglob("*.py") if BOUNDARY not in path.parents and path != CORE_SEAMS)
    foreign = foreign_private_names() - _own_private_names(files)
    touches = [touch for path in files for touch in private_touches(path, foreign)]
    assert touches == [], "TRL/transformers privates outside the boundary and the core's seams: " + ", ".join(touches)


def test_the_scan_finds_a_private_touch(tmp_path):
    """The scan is not vacuous: the kinds of touch the seam took over are found in a module that makes them."""
    module = tmp_path / "leaky.py"
    module.write_text(
        "from trl import GRPOTrainer\n"
        "class Leaky(GRPOTrainer):\n"
        "    _name = 'x'\n"
        "    def _prepare_inputs(self, batch):\n"
        "        self._metrics['train']['a'].append(1)\n"
        "        return self._buffered_inputs[self._step]\n"
        "def save(trainer):\n"
        "    trainer.model.config._name_or_path = 'x'\n"
        "    trainer.save_model('d', _internal_call=True)\n"
    )
    touches = private_touches(module, foreign_private_names())
    for expected in (
        "sets Leaky._name",
        "overrides Leaky._prepare_inputs",
        "._metrics",
        "._buffered_inputs",
        "._step",
        "_internal_call=",
        "._name_or_path",
    ):
        assert any(expected in touch for touch in touches), (expected, touches)


def test_python_dash_m_prints_each_seam_once_and_fails_none(capsys):
    """`python -m stapo_trl.trl_boundary`, the first command of a port to a new TRL (docs/records/drift-guard.md)."""
    import runpy

    runpy.run_module("stapo_trl.trl_boundary", run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"stapo-trl seams, tested with TRL {TESTED_TRL}.x; installed: TRL {trl.__version__}"
    verdicts = {
        seam.name: line.split()[0]
        for seam in SEAMS
        for line in lines[1:]
        if line == f"ok   {seam.name}" or line.startswith(f"skip {seam.name} (")
    }
    assert list(verdicts) == [seam.name for seam in SEAMS]
    assert {name for name, verdict in verdicts.items() if verdict == "skip"} == {
        seam.name for seam in SEAMS if not seam.can_check()
    }
    assert not [line for line in lines if line.startswith("FAIL")]
