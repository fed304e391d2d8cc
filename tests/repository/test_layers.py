"""The package's layers point one way: the core <- foundation <- TRL boundary helpers <- CPU runtime <- data <-
rewards <- method presets <- tools (evaluation, diagnostics, research tools, the model card, verl) <- command line. A
module imports only from its own layer or the layers below; the core imports nothing but the core.
"""

import ast
from pathlib import Path

import stapo_trl

PACKAGE = Path(stapo_trl.__file__).parent
ROOT = "stapo_trl"

LAYERS = (
    ("core", ("core", "version")),
    ("foundation", ("storage", "file_and_metric_names", "gguf")),
    ("TRL boundary helpers", ("trl_boundary",)),
    ("CPU runtime", ("cpu",)),
    ("data", ("data",)),
    ("rewards", ("rewards",)),
    ("method presets", ("methods",)),
    ("tools", ("evaluation", "diagnostics", "research", "card", "verl")),
    ("command line", ("cli", "__main__")),
)
"""Each layer and the top-level modules or subpackages of ``stapo_trl`` in it, lowest first. The package's own
``__init__`` is the public facade above them all: it loads names lazily, and no module imports it."""


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """The ``stapo_trl`` modules a file imports, at any depth of its code (function-level imports included)."""
    name = module_name(path, package_dir)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if node.module:
                    found.add(".".join([*base, node.module]))
                else:
                    found |= {".".join([*base, alias.name]) for alias in node.names}
            elif node.module and node.module.split(".")[0] == ROOT:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == ROOT}
    return found


def layer_of(module: str) -> int | None:
    """The layer index of a ``stapo_trl`` module, None for the package facade itself."""
    parts = module.split(".")
    if parts == [ROOT]:
        return None
    for index, (_, members) in enumerate(LAYERS):
        if parts[1] in members:
            return index
    raise AssertionError(
        f"{module} is in no layer: add its top-level name to LAYERS in tests/repository/test_layers.py"
    )


def upward_imports(package_dir: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        importer = module_name(path, package_dir)
        importer_layer = layer_of(importer)
        if importer_layer is None:
            continue
        for imported in sorted(imported_modules(path, package_dir)):
            imported_layer = layer_of(imported)
            if imported_layer is None:
                found.append(f"{importer} imports the package facade ({imported})")
            elif imported_layer > importer_layer:
                found.append(
                    f"{importer} ({LAYERS[importer_layer][0]}) imports {imported} ({LAYERS[imported_layer][0]})"
                )
    return found


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_runs_back_up_the_layers():
    assert upward_imports() == []


def test_an_upward_import_is_reported(tmp_path):
    """The scan is not vacuous: a data module importing a reward helper, relatively or absolutely, or the package
    facade, is reported."""
    package = tmp_path / ROOT
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "__init__.py").write_text("from .leak import gold\n")
    (package / "data" / "leak.py").write_text(
        "from ..rewards.text import completion_text\n"
        "def gold():\n"
        "    from stapo_trl.cli import main\n"
        "    from stapo_trl import STAPOTrainer\n"
    )
    assert upward_imports(package) == [
        "stapo_trl.data.leak imports the package facade (stapo_trl)",
        "stapo_trl.data.leak (data) imports stapo_trl.cli (command line)",
        "stapo_trl.data.leak (data) imports stapo_trl.rewards.text (rewards)",
    ]


PLOTTING_MODULE = "stapo_trl.diagnostics.plotting"


def matplotlib_importers(package_dir: Path = PACKAGE) -> list[str]:
    """The modules of the package whose code imports matplotlib, at any depth."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(name.split(".")[0] == "matplotlib" for name in names):
                found.append(module_name(path, package_dir))
                break
    return found


def test_one_module_draws_every_figure():
    """Training curves, the report and the evaluation chart all draw through diagnostics/plotting.py."""
    assert matplotlib_importers() == [PLOTTING_MODULE]


def test_a_second_plotting_module_is_reported(tmp_path):
    package = tmp_path / ROOT
    (package / "evaluation").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "evaluation" / "chart.py").write_text("def draw():\n    import matplotlib.pyplot as plt\n")
    (package / "plots.py").write_text("from matplotlib.colors import LogNorm\n")
    assert matplotlib_importers(package) == ["stapo_trl.evaluation.chart", "stapo_trl.plots"]


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package and the ``stapo_trl`` modules its code imports (function-level imports included)."""
    return {module_name(path, package_dir): imported_modules(path, package_dir) for path in package_dir.rglob("*.py")}


def reachable_modules(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module that importing ``start`` can import, directly or through others, each with the module that imports
    it on one path from ``start``. Importing ``a.b.c`` imports the packages ``a.b`` and ``a`` first."""

    def with_packages(module: str) -> list[str]:
        parts = module.split(".")
        return [".".join(parts[:end]) for end in range(2, len(parts) + 1)]

    assert start in graph, f"{start} is not a module of the package"
    found, pending = {}, [start]
    while pending:
        importer = pending.pop()
        for module in graph.get(importer, ()):
            for name in with_packages(module):
                if name not in found and name != start and name in graph:
                    found[name] = importer
                    pending.append(name)
    return found


PERIPHERY = tuple(f"{ROOT}.{name}" for _, members in LAYERS[1:] for name in members)
"""Everything but the core: what the core must not import, even through another module."""


def periphery_reached_from(start: str, graph: dict[str, set[str]] | None = None) -> list[str]:
    """The periphery modules that ``start`` imports, each as its import path (``a <- b <- start``)."""
    found = reachable_modules(start, import_graph() if graph is None else graph)
    paths = []
    for module in sorted(found):
        if any(module == root or module.startswith(f"{root}.") for root in PERIPHERY):
            chain = [module]
            while chain[-1] != start:
                chain.append(found[chain[-1]])
            paths.append(" <- ".join(chain))
    return paths


def test_the_trainer_and_the_config_reach_only_the_core():
    assert periphery_reached_from("stapo_trl.core.trainer") == []
    assert periphery_reached_from("stapo_trl.core.config") == []


def test_the_run_record_imports_no_figure():
    reached = reachable_modules("stapo_trl.diagnostics.run_record", import_graph())
    assert [module for module in reached if module.endswith(("plotting", "report_figures"))] == []


def test_an_indirect_import_of_the_periphery_is_reported():
    graph = {
        "stapo_trl.core": set(),
        "stapo_trl.core.trainer": {"stapo_trl.core.helper"},
        "stapo_trl.core.helper": {"stapo_trl.card.model_card"},
        "stapo_trl.card": set(),
        "stapo_trl.card.model_card": {"stapo_trl.diagnostics.plotting"},
        "stapo_trl.diagnostics": set(),
        "stapo_trl.diagnostics.plotting": set(),
    }
    assert periphery_reached_from("stapo_trl.core.trainer", graph) == [
        "stapo_trl.card <- stapo_trl.core.helper <- stapo_trl.core.trainer",
        "stapo_trl.card.model_card <- stapo_trl.core.helper <- stapo_trl.core.trainer",
        "stapo_trl.diagnostics <- stapo_trl.card.model_card <- stapo_trl.core.helper <- stapo_trl.core.trainer",
        "stapo_trl.diagnostics.plotting <- stapo_trl.card.model_card <- stapo_trl.core.helper <- "
        "stapo_trl.core.trainer",
    ]
