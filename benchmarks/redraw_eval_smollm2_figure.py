"""Redraw docs/eval_smollm2_results.png from the avg@k table in docs/records/evaluation-smollm2-135m-on-the-cpu.md.

The samples and summary.json of that evaluation were not kept, so the chart is drawn from the table's printed values
(two decimals) with `stapo-trl eval`'s own plotting:

    python benchmarks/redraw_eval_smollm2_figure.py
"""

from pathlib import Path

from stapo_trl.evaluation.results_table import PARTIAL_MARK, TableRow, plot_results

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
TABLE = [
    ("SmolLM2-135M-quickstart-stapo", "T=1.0, top-p=1.0", (0, 0, 0, 0, 0, 0), 0.0),
    ("SmolLM2-135M-quickstart-stapo", "T=0.7, top-p=0.9", (0, 8.33, 0, 0, 0, 0), 1.39),
    ("SmolLM2-135M-Instruct", "T=1.0, top-p=1.0", (0, 0, 0, 0, 8.33, 0), 1.39),
    ("SmolLM2-135M-Instruct", "T=0.7, top-p=0.9", (0, 0, 6.25, 6.25, 8.33, 0), 3.47),
]
"""(model, setting, avg@k per benchmark in %, average), as the table prints them; every cell is marked partial."""


def main() -> None:
    rows = [
        TableRow(
            model,
            setting,
            {},
            "",
            notes={PARTIAL_MARK},
            values=dict(zip(BENCHMARKS, values, strict=True)),
            average_value=mean,
        )
        for model, setting, values, mean in TABLE
    ]
    print(plot_results(rows, REPO / "docs" / "eval_smollm2_results.png", title="avg@k by benchmark"))


if __name__ == "__main__":
    main()
