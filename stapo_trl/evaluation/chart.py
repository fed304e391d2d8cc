"""The results table as a grouped bar chart: one group per benchmark (and the average), one bar per row, the paper's
rows hatched so they are never mistaken for measurements."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .paper import PAPER_BENCHMARKS
from .table import COLUMN_TITLES, OTHER_K_MARK, PARTIAL_MARK, TableRow

AVERAGE = "average"


def chart_series(rows: Sequence[TableRow]) -> dict[str, dict[str, float]]:
    """`{"<model> (<sampling>)": {benchmark or "average": avg@k %}}` for the cells a row has, in table order."""
    series = {}
    for row in rows:
        values = {name: row.values[name] for name in PAPER_BENCHMARKS if name in row.values}
        if row.average_value is not None:
            values[AVERAGE] = row.average_value
        series[f"{row.model} ({row.setting})"] = values
    return series


def plot_results(rows: Sequence[TableRow], path: str | Path, title: str | None = None) -> Path:
    """Write the chart as a PNG; renders headless (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("There are no result rows to plot.")
    series = chart_series(rows)
    groups = [name for name in (*PAPER_BENCHMARKS, AVERAGE) if any(name in values for values in series.values())]
    width = 0.8 / len(series)
    figure, axis = plt.subplots(
        figsize=(max(6.0, 1.3 * len(groups) + 0.25 * len(series)), 3.8), constrained_layout=True
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (row, (label, values)) in enumerate(zip(rows, series.items(), strict=True)):
        positions = [groups.index(name) - 0.4 + width * (index + 0.5) for name in values]
        axis.bar(
            positions,
            list(values.values()),
            width,
            label=label,
            color=colors[index % len(colors)],
            hatch="//" if row.source == "paper" else None,
            alpha=0.55 if row.source == "paper" else 1.0,
        )
    axis.set_xticks(range(len(groups)))
    axis.set_xticklabels([COLUMN_TITLES.get(name, "Avg") for name in groups])
    axis.set_ylabel("avg@k (%)")
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        axis.set_title(title, fontsize=10)
    if any(row.notes & {PARTIAL_MARK, OTHER_K_MARK} for row in rows):
        figure.supxlabel(
            "Some cells are on part of a benchmark or use another k than the paper; results.md marks them.", fontsize=7
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
