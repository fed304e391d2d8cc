"""The results table as a grouped bar chart: one group per benchmark (and the average), one bar per row, the paper's
rows hatched so they are never mistaken for measurements."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..diagnostics.plotting import BarGroup, plot_grouped_bars
from .paper_results import PAPER_BENCHMARKS
from .results_table import COLUMN_TITLES, OTHER_K_MARK, PARTIAL_MARK, TableRow

AVERAGE = "average"
PARTIAL_FOOTNOTE = "Some cells are on part of a benchmark or use another k than the paper; results.md marks them."


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
    if not rows:
        raise ValueError("There are no result rows to plot.")
    series = chart_series(rows)
    groups = [name for name in (*PAPER_BENCHMARKS, AVERAGE) if any(name in values for values in series.values())]
    bars = [BarGroup(*item, quoted=row.source == "paper") for row, item in zip(rows, series.items(), strict=True)]
    footnote = PARTIAL_FOOTNOTE if any(row.notes & {PARTIAL_MARK, OTHER_K_MARK} for row in rows) else None
    titles = {**COLUMN_TITLES, AVERAGE: "Avg"}
    return plot_grouped_bars(
        bars, groups, path, group_titles=titles, ylabel="avg@k (%)", title=title, footnote=footnote
    )
