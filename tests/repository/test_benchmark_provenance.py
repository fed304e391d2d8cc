"""Every benchmark JSON says where and when it was measured (issue 30): a ``provenance`` block with the date, the
commit, the package versions and the CPU model, written by ``benchmarks/provenance.py`` or, for JSONs written
before it existed, reconstructed afterwards from git history, with ``null`` only for what was not recorded then."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = sorted((REPO / "docs" / "benchmarks").glob("*.json"))
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in ("provenance.py", "peak_rss.py"))
KEYS = ("date", "commit", "packages", "cpu")
AFTERWARDS = "afterwards, from git history"


def load_provenance_module():
    spec = importlib.util.spec_from_file_location("benchmark_provenance", BENCHMARKS / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def writes_a_json(source: str) -> bool:
    """The script takes an ``--out``/``--output`` option and dumps JSON: it writes a benchmark JSON."""
    options = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options |= {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
    return bool(options & {"--out", "--output"}) and re.search(r"json\.dumps?\(", source) is not None


def test_there_are_results_and_scripts_to_check():
    assert len(RESULTS) >= 10
    assert sum(writes_a_json(path.read_text()) for path in SCRIPTS) >= 13


@pytest.mark.parametrize("path", RESULTS, ids=lambda path: path.name)
def test_every_benchmark_json_has_a_provenance_block(path):
    block = json.loads(path.read_text())["provenance"]
    assert set(KEYS) <= set(block), f"{path.name}: missing {set(KEYS) - set(block)}"
    missing = [key for key in KEYS if block[key] is None]
    if missing:  # allowed only in a block reconstructed afterwards, and only where it says so
        assert block.get("recorded") == AFTERWARDS, path.name
        assert set(missing) == set(block["not_recorded"]), path.name
        assert "not recorded at the time" in block["note"], path.name
    assert block["date"] is not None and re.match(r"\d{4}-\d{2}-\d{2}", block["date"]), path.name
    assert block["commit"] is not None and re.match(r"[0-9a-f]{7,40}\b", block["commit"]), path.name
    if block["packages"] is not None:
        assert block["packages"] and all(isinstance(v, str) for v in block["packages"].values()), path.name
    if block["cpu"] is not None:
        assert isinstance(block["cpu"], str) and block["cpu"], path.name


@pytest.mark.parametrize("path", RESULTS, ids=lambda path: path.name)
def test_a_reconstructed_block_names_a_commit_that_wrote_the_file_on_its_date(path):
    block = json.loads(path.read_text())["provenance"]
    if block.get("recorded") != AFTERWARDS:
        pytest.skip("recorded at the time")
    shown = subprocess.run(
        ["git", "log", "-1", "--format=%H %cs", block["commit"], "--", f"docs/benchmarks/{path.name}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0 or not shown.stdout.strip():
        pytest.skip("the commit is not in this clone's history (a shallow clone?)")
    assert shown.stdout.split() == [block["commit"], block["date"]], "that commit did not write this file"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_every_benchmark_script_that_writes_a_json_records_its_provenance(path):
    source = path.read_text()
    if not writes_a_json(source):
        pytest.skip("writes no JSON")
    assert re.search(r"^from provenance import .*\bprovenance\b", source, flags=re.MULTILINE), path.name
    assert "provenance()" in source, path.name
    assert '"provenance":' in source, path.name


def test_provenance_records_the_date_commit_versions_and_cpu():
    block = load_provenance_module().provenance()
    assert set(KEYS) <= set(block)
    assert re.match(r"\d{4}-\d{2}-\d{2}T", block["date"])
    assert block["packages"]["torch"] and block["cpu"]


def test_the_docs_name_every_reconstructed_block():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for path in RESULTS:
        if json.loads(path.read_text())["provenance"].get("recorded") == AFTERWARDS:
            assert f"`{path.stem}`" in text.split("\n## ", 1)[0], path.name
