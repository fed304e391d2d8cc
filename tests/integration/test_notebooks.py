"""The notebooks run from top to bottom with papermill, with `SMOKE=True` (tiny CPU settings, shipped data, no vLLM),
and are committed without outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat and papermill (the dev extra)")
papermill = pytest.importorskip("papermill", reason="the notebook tests need nbformat and papermill (the dev extra)")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["01_quickstart_cpu.ipynb", "02_dapo_math_qwen3.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_the_notebook_is_committed_clean_with_a_papermill_parameters_cell(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "clear the outputs"
    (parameters,) = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert "SMOKE = False" in parameters.source and "OUTPUT_DIR = " in parameters.source


def execute(name: str, output_dir: Path, tmp_path: Path) -> nbformat.NotebookNode:
    executed = tmp_path / name
    papermill.execute_notebook(
        str(NOTEBOOKS / name),
        str(executed),
        parameters={"SMOKE": True, "OUTPUT_DIR": str(output_dir)},
        cwd=str(NOTEBOOKS),
        kernel_name="python3",
        progress_bar=False,
    )
    return nbformat.read(executed, as_version=4)


def printed(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.get("output_type") == "stream"
    )


def images(notebook: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )


@pytest.mark.slow
def test_the_cpu_quickstart_notebook_trains_evaluates_reports_and_writes_a_card(tmp_path):
    output_dir = tmp_path / "quickstart"
    notebook = execute("01_quickstart_cpu.ipynb", output_dir, tmp_path)
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_before"]["total"] == summary["accuracy_after"]["total"] == 4
    assert "accuracy " in printed(notebook) and "S2T silenced" in printed(notebook)
    assert images(notebook) >= 3  # the report's figures, shown inline
    card = (output_dir / "README.md").read_text()
    assert "Trained with **STAPO**" in card and "Held-out greedy accuracy (4 problems)" in card
    assert "### Recipe" in card and "smollm2-135m-cpu.yaml" in card
    assert "The card passes the offline metadata checks." in printed(notebook)


@pytest.mark.slow
def test_the_qwen3_notebook_trains_evaluates_reports_and_refreshes_the_card_on_the_cpu(tmp_path):
    output_dir = tmp_path / "qwen3"
    notebook = execute("02_dapo_math_qwen3.ipynb", output_dir, tmp_path)
    assert json.loads((output_dir / "run_summary.json").read_text())["steps"] == 2
    assert (output_dir / "config.json").is_file() and "Qwen3ForCausalLM" in (output_dir / "config.json").read_text()
    assert json.loads((output_dir / "eval" / "summary.json").read_text())["settings"]
    assert images(notebook) >= 3
    card = (output_dir / "README.md").read_text()
    assert "### Evaluation" in card and "`stapo-trl eval` (eval/summary.json" in card
    assert "notebook-recipe.yaml" in card and "dump_silenced_tokens: true" in card
    setup = next(cell.source for cell in notebook.cells if "REPO = next(" in cell.source)
    assert "push_to_hub" in setup  # with HUB_MODEL_ID, the trainer pushes, as with TRL
