"""The results table in the paper's layout: one row per model and sampling setting, one column per benchmark, and
the average, with the paper's own row (clearly labelled) under ours when it has one for the same size and method; and
the same rows as a grouped bar chart, the paper's rows hatched so they are never mistaken for measurements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.benchmarks import BENCHMARKS
from ..diagnostics.plotting import BarGroup, plot_grouped_bars
from .paper_results import PAPER_BENCHMARKS, PAPER_SOURCE, paper_row

COLUMN_TITLES = dict(
    zip(PAPER_BENCHMARKS, ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad"), strict=True)
)
PARTIAL_MARK = "*"
OTHER_K_MARK = "†"
SUBSET_AVERAGE_MARK = "‡"
MARK_LEGENDS = {
    PARTIAL_MARK: "on part of the benchmark only (shipped samples, a local subset or max_problems, or an unfinished "
    "run): not comparable with the paper.",
    OTHER_K_MARK: "k differs from the paper's.",
    SUBSET_AVERAGE_MARK: "average over the benchmarks evaluated; the paper averages all six.",
}


@dataclass
class TableRow:
    """One table row: `cells` and `average` as printed (with marks), `values` and `average_value` as numbers."""

    model: str
    setting: str
    cells: dict[str, str]
    average: str
    source: str = "ours"
    notes: set[str] = field(default_factory=set)
    values: dict[str, float] = field(default_factory=dict)
    average_value: float | None = None


def _format(value: float) -> str:
    return f"{value:.2f}"


def summary_rows(summary: dict[str, Any], *, with_paper: bool = True) -> list[TableRow]:
    """Rows for one evaluation summary (as written to summary.json), each followed by the paper's row if any."""
    rows = []
    model = summary["model"]
    for setting in summary["settings"]:
        scores, cells, notes = setting["benchmarks"], {}, set()
        for name, score in scores.items():
            partial = bool(score.get("partial")) or not score.get("complete", True)
            other_k = score["samples_per_problem"] != BENCHMARKS[name].samples_per_problem
            marks = PARTIAL_MARK * partial + OTHER_K_MARK * other_k
            notes.update(marks)
            cells[name] = _format(score["avg_at_k"]) + marks
        average, text = (setting["average"], _format(setting["average"])) if scores else (None, "–")
        if scores and set(scores) != set(PAPER_BENCHMARKS):
            text += SUBSET_AVERAGE_MARK
            notes.add(SUBSET_AVERAGE_MARK)
        values = {name: score["avg_at_k"] for name, score in scores.items()}
        rows.append(TableRow(model["label"], setting["label"], cells, text, "ours", notes, values, average))
        paper = paper_row(model.get("size"), model.get("method"), setting["name"]) if with_paper else None
        if paper is not None:
            cells = {name: _format(value) for name, value in paper.scores.items()}
            text, values = _format(paper.average), dict(paper.scores)
            rows.append(TableRow(paper.label, setting["label"], cells, text, "paper", set(), values, paper.average))
    return rows


def markdown_table(rows: Sequence[TableRow]) -> str:
    """A GitHub Markdown table of the rows, with a legend for the marks used."""
    header = ["model", "sampling", *(COLUMN_TITLES[name] for name in PAPER_BENCHMARKS), "Avg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(PAPER_BENCHMARKS) + 1)]
    for row in rows:
        cells = [row.cells.get(name, "–") for name in PAPER_BENCHMARKS]
        lines.append("| " + " | ".join([row.model, row.setting, *cells, row.average]) + " |")
    notes = set().union(*(row.notes for row in rows)) if rows else set()
    legend = ["", "avg@k in %: k = 32 on AIME24, AIME25 and AMC23 and 4 on the others, as in the paper."]
    legend += [f"{mark} {text}" for mark, text in MARK_LEGENDS.items() if mark in notes]
    if any(row.source == "paper" for row in rows):
        legend.append(f"Rows labelled `paper:` are copied from the {PAPER_SOURCE}, not measured here.")
    return "\n".join(lines + legend) + "\n"


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
