"""docs/study.png is drawn from docs/benchmarks/study.json by benchmarks/bench_study.py (`--replot`): every panel has
its curves, and every legend names the runs behind a curve (the method and its seeds), never a bare method key."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUDY = json.loads((REPO / "docs" / "benchmarks" / "study.json").read_text())


@pytest.fixture(scope="module")
def bench_study():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the script imports its neighbour provenance.py
    try:
        spec = importlib.util.spec_from_file_location("bench_study", REPO / "benchmarks" / "bench_study.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_every_panel_drawn_from_the_stored_study_has_its_curves(bench_study):
    panels = bench_study.curve_panels(STUDY["summary"], STUDY["runs"])
    assert len(panels) == len(bench_study.CURVES)
    for panel in panels:
        assert panel.series and not panel.notes, panel.title
        assert all(series.defined for series in panel.series), panel.title
    # the logit-level formula was logged under an earlier name in these runs, and is still drawn
    formula = panels[list(bench_study.CURVES).index("s2t/logit_grad_sq_share_estimate")]
    assert [series.label for series in formula.series] == ["STAPO (seeds 0, 1, 2)"]
    assert "not a measurement" in formula.title


def test_the_legends_name_each_method_and_its_seeds(bench_study):
    panels = bench_study.curve_panels(STUDY["summary"], STUDY["runs"])
    assert [series.label for series in panels[0].series] == [
        "STAPO (seeds 0, 1, 2)",
        "GRPO (seeds 0, 1, 2)",
        "20-Entropy (seeds 0, 1, 2)",
    ]
    one_seed = {"stapo-seed3": {"method": "stapo", "seed": 3}}
    assert bench_study.method_label("stapo", one_seed) == "STAPO (seed 3)"


def test_the_figure_renders_from_the_stored_study(bench_study, tmp_path):
    path = bench_study.plot(STUDY["summary"], STUDY["runs"], tmp_path / "study.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
