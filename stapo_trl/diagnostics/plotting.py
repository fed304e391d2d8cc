"""Every figure the package draws, as PNGs of what the data classes below state; the only module that imports
matplotlib (headless Agg, inside the drawing functions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Series:
    """One run's line in a panel; a None value (a step logged without one) breaks the line."""

    label: str
    steps: list[int]
    values: list[float | None]
    band: tuple[list[float | None], list[float | None]] | None = None
    """``(low, high)`` per step, drawn as a shaded band."""

    @property
    def defined(self) -> list[tuple[int, float]]:
        return [(step, value) for step, value in zip(self.steps, self.values, strict=True) if value is not None]

    @property
    def undefined_steps(self) -> list[int]:
        return [step for step, value in zip(self.steps, self.values, strict=True) if value is None]


@dataclass
class LinePanel:
    """A panel of one metric over the optimizer steps, one series per run. ``y_floor`` is the lowest value the axis
    shows; ``undefined_label`` names what a step without a value (marked on the x axis) means; ``notes`` say why a
    run has no line, or, when no run has one, fill the panel."""

    title: str
    series: list[Series]
    y_floor: float | None = None
    undefined_label: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class TokenBars:
    """One run's most frequent silenced tokens and their counts; or ``rows`` of a table of tokens in context (step,
    token in context, p, H, A); or a note saying why there are none."""

    title: str
    tokens: list[str]
    counts: list[int]
    note: str | None = None
    rows: list[tuple[str, ...]] | None = None


@dataclass
class DensityPanel:
    """One run's p-H density: ``counts[i][j]`` tokens in bin i of log10 p and j of H over ``extent`` (log10 p low,
    high, H low, high); the silencing region ``silenced_box`` (log10 probability bound, median threshold), or the
    bound alone (``threshold_only``); the dumped silenced tokens as ``(log10 p, H)``."""

    title: str
    counts: list[list[int]] | None = None
    extent: tuple[float, float, float, float] | None = None
    silenced_box: tuple[float, float] | None = None
    threshold_only: float | None = None
    silenced: list[tuple[float, float]] = field(default_factory=list)
    note: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(map(sum, self.counts)) if self.counts else 0


@dataclass
class BarGroup:
    """One row of a grouped bar chart: its value in each group; a row ``quoted`` rather than measured is hatched."""

    label: str
    values: dict[str, float]
    quoted: bool = False


def _floats(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if value is None else value for value in values], dtype=float)


def pyplot():
    """matplotlib's pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panel_row(count: int, panel_size: tuple[float, float], **options):
    """A figure and its one row of ``count`` axes, each ``panel_size`` inches."""
    size = (panel_size[0] * count, panel_size[1])
    figure, axes = pyplot().subplots(1, count, figsize=size, constrained_layout=True, squeeze=False, **options)
    return figure, axes[0]


def _note(axis, text: str) -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, transform=axis.transAxes)


def save_figure(figure, path: str | Path, dpi: int = 100, title: str | None = None, title_size: int = 11) -> Path:
    """Write ``figure``, titled ``title``, to ``path`` (its directory is created) and close it."""
    if title:
        figure.suptitle(title, fontsize=title_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path


def draw_line_panel(axis, panel: LinePanel) -> None:
    """Draw a :class:`LinePanel`: lines broken at undefined steps, which are marked on the x axis, and its notes."""
    undefined_label = panel.undefined_label  # in the legend once
    for series in panel.series:
        (line,) = axis.plot(series.steps, _floats(series.values), marker="o", markersize=3, label=series.label)
        if series.band is not None:
            low, high = map(_floats, series.band)
            if panel.y_floor is not None:
                low = np.maximum(low, panel.y_floor)
            axis.fill_between(series.steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        if undefined := series.undefined_steps:
            cross = {"linestyle": "none", "marker": "x", "markersize": 7, "markeredgewidth": 1.5}
            on_axis = {"transform": axis.get_xaxis_transform(), "color": line.get_color()}
            axis.plot(undefined, [0.04] * len(undefined), label=undefined_label, **cross, **on_axis)
            undefined_label = None
    if panel.y_floor is not None:
        axis.set_ylim(panel.y_floor, max(axis.get_ylim()[1], panel.y_floor + 1e-3))
    title = panel.title
    if panel.notes and any(series.defined for series in panel.series):
        title += "\n" + "; ".join(panel.notes)
    elif panel.notes:
        _note(axis, "\n".join(panel.notes))
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("optimizer step")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc="best")


def plot_line_panels(
    panels: Sequence[LinePanel],
    path: str | Path,
    *,
    panel_size: tuple[float, float] = (5.5, 3.8),
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Write a row of :class:`LinePanel`\\ s as one PNG."""
    figure, axes = panel_row(len(panels), panel_size)
    for axis, panel in zip(axes, panels, strict=True):
        draw_line_panel(axis, panel)
    return save_figure(figure, path, dpi, title)


def plot_token_bars(bars: Sequence[TokenBars], path: str | Path, limit: int = 15) -> Path:
    """One panel per run: a horizontal bar chart of its silenced tokens, a table of them in context, or its note."""
    width = 10.5 if any(run_bars.rows for run_bars in bars) else 4.6
    figure, axes = panel_row(len(bars), (width, 0.3 * limit + 1.6))
    for axis, run_bars in zip(axes, bars, strict=True):
        axis.set_title(run_bars.title, fontsize=10)
        if run_bars.note or run_bars.rows:
            axis.set(xticks=[], yticks=[])
        if run_bars.note:
            _note(axis, run_bars.note)
            continue
        if run_bars.rows:
            axis.set_frame_on(False)
            labels, widths = ["step", "token in context", "p", "H", "A"], [0.06, 0.70, 0.08, 0.07, 0.09]
            placement = {"cellLoc": "left", "bbox": [0.0, 0.0, 1.0, 1.0]}
            table = axis.table(cellText=run_bars.rows, colLabels=labels, colWidths=widths, **placement)
            table.auto_set_font_size(False)
            table.set_fontsize(7.5)
            for cell in table.get_celld().values():
                cell.PAD = 0.02 / max(cell.get_width(), 0.02)  # a fixed small padding, not a tenth of the width
            continue
        positions = range(len(run_bars.tokens))
        axis.barh(positions, run_bars.counts, color="tab:red")
        axis.set_yticks(positions, run_bars.tokens, fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("times silenced (in the dump)")
        axis.xaxis.get_major_locator().set_params(integer=True)
    return save_figure(figure, path)


def plot_density_panels(panels: Sequence[DensityPanel], path: str | Path, limits: tuple[float, float] | None) -> Path:
    """One p-H density of positive-advantage tokens per run on shared axes, from ``limits`` (lowest log10 p, highest H)
    to ``log10 p = 0`` and ``H = 0``: a log-scaled histogram, the silencing region as a dashed box (or the probability
    bound as a dashed line), and the silenced tokens as crosses."""
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    figure, axes = panel_row(len(panels), (5.2, 4.2), sharex=True, sharey=True)
    for axis, panel in zip(axes, panels, strict=True):
        axis.set_title(panel.title, fontsize=10)
        axis.set_xlabel("log10 p (probability of the sampled token)")
        if panel.note:
            _note(axis, panel.note)
        if panel.counts is None:
            continue
        counts = np.array(panel.counts, dtype=float)
        x_low, x_high, y_low, y_high = panel.extent
        if counts.sum() > 0:
            norm = LogNorm(vmin=1, vmax=max(counts.max(), 2))
            shown = np.ma.masked_equal(counts.T, 0)
            image = axis.imshow(shown, origin="lower", extent=panel.extent, aspect="auto", norm=norm, cmap="viridis")
            figure.colorbar(image, ax=axis, label="tokens (A > 0)")
        if panel.silenced_box is not None:
            log10_threshold, tau_h = panel.silenced_box
            label = f"silenced: p < {10**log10_threshold:.3g}, H < {tau_h:.2f}\n(the median of the per-step tau_h)"
            style = {"fill": False, "edgecolor": "red", "linestyle": "--", "linewidth": 1.5, "label": label}
            axis.add_patch(Rectangle((x_low, y_low), log10_threshold - x_low, tau_h - y_low, **style))
        elif panel.threshold_only is not None:
            axis.axvline(panel.threshold_only, color="red", linestyle="--", linewidth=1.2)
            label = f"p = {10**panel.threshold_only:.3g}; no candidates, no tau_h"
            axis.plot([], [], color="red", linestyle="--", label=label)
        if panel.silenced:
            x, y = zip(*panel.silenced, strict=True)
            axis.scatter(x, y, s=14, marker="x", color="red", linewidths=1.0, label="silenced (dumped)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("H: entropy at the position (nats)")
    if limits is not None:
        axes[0].set(xlim=(limits[0], 0.0), ylim=(0.0, limits[1]))
    return save_figure(figure, path, title="Positive-advantage completion tokens over probability and entropy")


ZERO_LABEL = "0"
"""The label written above a bar whose value is 0, so that a zero reads as a value and not as a missing bar."""


def draw_grouped_bars(
    axis,
    rows: Sequence[BarGroup],
    groups: Sequence[str],
    *,
    group_titles: Mapping[str, str] | None = None,
    ylabel: str = "",
) -> None:
    """Draw a grouped bar chart on ``axis``: one group per entry of ``groups``, one bar per row that has a value there,
    a legend naming every row; a 0 gets a stub labelled `ZERO_LABEL`; the axis starts at 0 (or below)."""
    width = 0.8 / len(rows)
    colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    lowest, highest = 0.0, 0.0
    for index, row in enumerate(rows):
        present = [name for name in groups if name in row.values]
        positions = [groups.index(name) - 0.4 + width * (index + 0.5) for name in present]
        values = [row.values[name] for name in present]
        color, alpha = colors[index % len(colors)], 0.55 if row.quoted else 1.0
        axis.bar(
            positions, values, width, label=row.label, color=color, hatch="//" if row.quoted else None, alpha=alpha
        )
        zeros = np.array([position for position, value in zip(positions, values, strict=True) if value == 0])
        if len(zeros):
            stub = {"colors": color, "linewidth": 3, "alpha": alpha, "clip_on": False, "zorder": 3}
            axis.hlines(np.zeros(len(zeros)), zeros - 0.45 * width, zeros + 0.45 * width, **stub)
            text = {"xytext": (0, 2.5), "textcoords": "offset points", "ha": "center", "va": "bottom", "fontsize": 6}
            for position in zeros:
                axis.annotate(ZERO_LABEL, (position, 0.0), color=color, **text)
        lowest, highest = min([lowest, *values]), max([highest, *values])
    axis.set_ylim(lowest * 1.08 if lowest < 0 else 0.0, highest * 1.08 if highest > 0 else 1.0)
    axis.set_xticks(range(len(groups)), [(group_titles or {}).get(name, name) for name in groups])
    axis.set_ylabel(ylabel)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def plot_grouped_bars(
    rows: Sequence[BarGroup],
    groups: Sequence[str],
    path: str | Path,
    *,
    group_titles: Mapping[str, str] | None = None,
    ylabel: str = "",
    title: str | None = None,
    footnote: str | None = None,
) -> Path:
    """Write :func:`draw_grouped_bars`'s chart as a PNG."""
    figure, (axis,) = panel_row(1, (max(6.0, 1.3 * len(groups) + 0.25 * len(rows)), 3.8))
    draw_grouped_bars(axis, rows, groups, group_titles=group_titles, ylabel=ylabel)
    if title:
        axis.set_title(title, fontsize=10)
    if footnote:
        figure.supxlabel(footnote, fontsize=7)
    return save_figure(figure, path, dpi=110)


@dataclass
class DifferenceRow:
    """One comparison: its paired differences, their mean and 95% interval (None if too few), and each group's mean."""

    label: str
    values: list[float]
    mean: float | None
    low: float | None
    high: float | None
    group_means: list[float] = field(default_factory=list)


@dataclass
class DifferencePanel:
    title: str
    rows: list[DifferenceRow]
    xlabel: str = ""


def plot_difference_panels(panels: Sequence[DifferencePanel], path: str | Path, title: str | None = None) -> Path:
    """One panel per measure, one row per comparison: every paired difference as a dot, each group's mean as a
    diamond, and the mean with its 95% interval as a bar, beside a line at 0."""
    rows = max(len(panel.rows) for panel in panels)
    figure, axes = panel_row(len(panels), (4.2, 0.55 * rows + 1.6), sharey=True)
    for axis, panel in zip(axes, panels, strict=True):
        labels = [row.label for row in panel.rows]
        for index, row in enumerate(panel.rows):
            y = len(panel.rows) - 1 - index
            if not row.values:
                where = {"xycoords": ("axes fraction", "data"), "ha": "center", "va": "center"}
                axis.annotate("no generation", (0.5, y), fontsize=7, color="0.4", **where)
                continue
            jitter = np.linspace(-0.15, 0.15, len(row.values)) if len(row.values) > 1 else np.zeros(1)
            axis.scatter(row.values, y + jitter, s=8, alpha=0.35, color="C0", zorder=2)
            if row.group_means:
                axis.scatter(
                    row.group_means, [y + 0.25] * len(row.group_means), s=22, marker="D", color="C1", zorder=3
                )
            if row.low is not None and row.high is not None:
                axis.hlines(y, row.low, row.high, color="C3", linewidth=2.5, zorder=3)
            if row.mean is not None:
                axis.plot([row.mean], [y], marker="|", markersize=14, color="C3", zorder=4)
        axis.axvline(0.0, color="0.3", linewidth=0.8)
        axis.set_yticks(range(len(labels)), list(reversed(labels)), fontsize=8)
        axis.set_ylim(-0.6, len(labels) - 0.4)
        axis.set_title(panel.title, fontsize=9)
        axis.set_xlabel(panel.xlabel, fontsize=8)
        axis.grid(axis="x", alpha=0.3)
    return save_figure(figure, path, 110, title, title_size=10)
