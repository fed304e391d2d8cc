"""`stapo-trl report`: plots and a summary of one or more training runs, read from the trainer's own logs.

A run directory is read from ``trainer_state.json`` (TRL's log history: the output dir's own, which `stapo-trl train`
writes, else the newest ``checkpoint-N/``), else from ``metrics.jsonl``; the silenced-token dump
(``silenced_tokens.jsonl`` and ``silenced_tokens_stats.json``, see :mod:`.token_dump`) adds the p-H density and the
top silenced tokens. Every figure draws all runs on shared axes, so that runs can be compared at a glance.
"""

from __future__ import annotations

import base64
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..jsonl import read_json_lines
from ..names import METRICS_FILE, SILENCED_TOKENS_FILE, SILENCED_TOKENS_STATS_FILE, TRAINER_STATE_FILE
from ..resume import last_complete_checkpoint

REPORT_FILE = "report.md"
HTML_FILE = "report.html"

FIGURES = {
    "entropy": "entropy.png",
    "reward": "reward.png",
    "masking": "masking.png",
    "token_density": "token_density.png",
    "top_silenced_tokens": "top_silenced_tokens.png",
}


class ReportError(UsageError, ValueError):
    """A run directory that cannot be reported on, with what is missing and how to get it."""


@dataclass
class RunLogs:
    """What one run directory holds for the report."""

    label: str
    directory: Path
    history: list[dict[str, Any]]
    source: Path
    silenced_tokens: list[dict[str, Any]] | None = None
    dump_stats: dict[str, Any] | None = None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def find_log_source(directory: Path) -> Path | None:
    """The file a run's training log is read from: its ``trainer_state.json``, the newest checkpoint's, or
    ``metrics.jsonl``; None when there is none."""
    own = directory / TRAINER_STATE_FILE
    if own.is_file():
        return own
    checkpoint = last_complete_checkpoint(directory)
    if checkpoint is not None:
        return checkpoint / TRAINER_STATE_FILE
    metrics = directory / METRICS_FILE
    return metrics if metrics.is_file() else None


def read_history(source: Path) -> list[dict[str, Any]]:
    """The per-step training records of a ``trainer_state.json`` or ``metrics.jsonl`` (the end-of-training summary
    record, which has ``train_runtime``, is left out)."""
    from ..plots import read_metrics

    try:
        if source.name == METRICS_FILE:
            records = read_metrics(source)
        else:
            records = json.loads(source.read_text()).get("log_history", [])
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise ReportError(
            f"{source} cannot be read ({error}); the file is damaged. Point the report at a checkpoint-N/ of the run, "
            "whose trainer_state.json holds the log up to that step."
        ) from None
    return [record for record in records if "step" in record and "train_runtime" not in record]


def load_run(directory: str | Path, label: str | None = None) -> RunLogs:
    """Read one run directory, or raise :class:`ReportError` saying what is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory}: no such directory.")
    source = find_log_source(directory)
    if source is None:
        raise ReportError(
            f"{directory}: no training log found. The report reads {TRAINER_STATE_FILE} (written at the end of "
            f"`stapo-trl train`, by `trainer.save_state()`, and in every checkpoint-N/) or {METRICS_FILE} (written "
            "by `stapo-trl train`). Point it at a training output_dir, or call trainer.save_state() after "
            "trainer.train() in your own script."
        )
    history = read_history(source)
    if not history:
        raise ReportError(
            f"{source}: the log holds no training steps. Was the run stopped before its first logging step "
            "(logging_steps)?"
        )
    run = RunLogs(label=label or directory.resolve().name, directory=directory, history=history, source=source)
    records_path, stats_path = directory / SILENCED_TOKENS_FILE, directory / SILENCED_TOKENS_STATS_FILE
    if stats_path.is_file():
        run.dump_stats = json.loads(stats_path.read_text())
    if records_path.is_file():
        run.silenced_tokens = read_silenced_tokens(records_path)
    return run


def read_silenced_tokens(path: Path) -> list[dict[str, Any]]:
    """The records of a ``silenced_tokens.jsonl``. A last line cut off mid-write (what a killed run leaves) is left
    out; any other line that is not JSON is a :class:`ReportError`."""
    try:
        return read_json_lines(path)
    except ValueError as error:
        raise ReportError(str(error)) from None


def series(history: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one logged metric, leaving out steps where it is missing or not finite."""
    points = [(record["step"], scale * record[key]) for record in history if _finite(record.get(key))]
    return [step for step, _ in points], [value for _, value in points]


def quarter_means(values: list[float]) -> tuple[float, float] | None:
    """The means of the first and the last quarter (at least one value each) of a series, or None when empty."""
    if not values:
        return None
    quarter = max(1, len(values) // 4)
    return sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter


def visible_token(text: str) -> str:
    """A token's text with its whitespace made visible, for axis labels and tables."""
    shown = text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return shown if shown else "∅"


def top_silenced_tokens(run: RunLogs, limit: int = 15) -> list[tuple[str, int]]:
    """The most frequent token texts among the run's dumped silenced tokens (a sample when the caps dropped some)."""
    counts = Counter(record["token"] for record in run.silenced_tokens or [])
    return counts.most_common(limit)


def summarize_run(run: RunLogs) -> dict[str, Any]:
    """The numbers the report's table shows for one run."""
    summary: dict[str, Any] = {"label": run.label, "steps": max(record["step"] for record in run.history)}
    for key, name in (("reward", "reward"), ("entropy", "entropy")):
        means = quarter_means(series(run.history, key)[1])
        if means is not None:
            summary[f"{name}_first_quarter"], summary[f"{name}_last_quarter"] = means
    _, masked = series(run.history, "s2t/masked_fraction")
    if masked:
        summary["masked_fraction"] = sum(masked) / len(masked)
        summary["masked_tokens"] = int(sum(series(run.history, "s2t/num_masked")[1]))
        summary["candidates"] = int(sum(series(run.history, "s2t/num_candidates")[1]))
    _, thresholds = series(run.history, "s2t/entropy_threshold")
    if thresholds:
        summary["tau_h_median"] = statistics.median(thresholds)
    if run.dump_stats is not None:
        for key in ("silenced", "written", "dropped"):
            summary[f"dump_{key}"] = run.dump_stats[key]
    return summary


def entropy_trend(summary: dict[str, Any]) -> str:
    """'falls', 'rises' or 'stays flat' (within 5%) from the first to the last quarter of the steps."""
    first, last = summary.get("entropy_first_quarter"), summary.get("entropy_last_quarter")
    if first is None or last is None:
        return "not logged"
    if abs(last - first) <= 0.05 * max(abs(first), 1e-12):
        return f"stays flat ({first:.3f} -> {last:.3f} nats)"
    return f"{'falls' if last < first else 'rises'} ({first:.3f} -> {last:.3f} nats)"


# ------------------------------------------------------------------------------------------------- figure data
# Each figure is built in two steps: a pure function computes what it shows (the series, labels and notes, which the
# tests pin), and a drawing function renders that with matplotlib.
S2T_KEYS = ("s2t/masked_fraction", "s2t/entropy_threshold")


@dataclass
class Series:
    """One run's line in a panel. ``values[i]`` is None where the metric was logged without a value at
    ``steps[i]`` (for ``tau_h``: a step without candidates); the line breaks there."""

    label: str
    steps: list[int]
    values: list[float | None]
    band: tuple[list[float | None], list[float | None]] | None = None
    """Optional ``(low, high)`` per step, drawn as a shaded band (for example mean ± sd over seeds)."""

    @property
    def defined(self) -> list[tuple[int, float]]:
        return [(step, value) for step, value in zip(self.steps, self.values, strict=True) if value is not None]

    @property
    def undefined_steps(self) -> list[int]:
        return [step for step, value in zip(self.steps, self.values, strict=True) if value is None]


@dataclass
class LinePanel:
    """A panel of one metric over the optimizer steps, one series per run that logged it.

    ``y_floor`` is the lowest value the axis shows (0 for fractions and entropies, which cannot be negative).
    ``undefined_label`` names what a logged step without a value means; such steps are marked on the x axis.
    ``notes`` say why a run has no line, or why no line has a point.
    """

    title: str
    series: list[Series]
    y_floor: float | None = None
    undefined_label: str | None = None
    notes: list[str] = field(default_factory=list)


def metric_series(history: list[dict[str, Any]], key: str, label: str, scale: float = 1.0) -> Series | None:
    """The series of ``key`` in a run's log, or None when no record has the key. A record where it is None or not
    finite (TRL logs None when every value of the window was NaN) gives a None value."""
    logged = [record for record in history if key in record]
    if not logged:
        return None
    values = [scale * record[key] if _finite(record[key]) else None for record in logged]
    return Series(label=label, steps=[record["step"] for record in logged], values=values)


def line_panel(
    runs: list[RunLogs],
    key: str,
    title: str,
    *,
    scale: float = 1.0,
    y_floor: float | None = None,
    absent: str = "not logged",
    undefined_label: str | None = None,
) -> LinePanel:
    """The panel of ``key`` over the runs; a run without the key gets the note ``"<label>: <absent>"``."""
    panel = LinePanel(title=title, series=[], y_floor=y_floor, undefined_label=undefined_label)
    for run in runs:
        found = metric_series(run.history, key, run.label, scale)
        if found is None:
            panel.notes.append(f"{run.label}: {absent}")
        else:
            panel.series.append(found)
    if panel.series and not any(series.defined for series in panel.series) and undefined_label:
        panel.notes.append(f"{undefined_label} at every logged step")
    return panel


def masking_panels(runs: list[RunLogs]) -> tuple[LinePanel, LinePanel]:
    """The S2T masked fraction (%) and ``tau_h`` over the steps. The legend of the first says how many tokens each
    run silenced of how many candidates."""
    absent = "no S2T statistics (the run did not use the S2T mask)"
    fraction = line_panel(
        runs, "s2t/masked_fraction", "S2T masked fraction of loss tokens (%)", scale=100.0, y_floor=0.0, absent=absent
    )
    by_label = {run.label: summarize_run(run) for run in runs}
    for series in fraction.series:
        summary = by_label[series.label]
        if series.defined and all(value == 0.0 for _, value in series.defined):
            fraction.notes.append(f"{series.label}: 0% at every step")
        series.label = f"{series.label}: {summary['masked_tokens']} of {summary['candidates']} candidates silenced"
    threshold = line_panel(
        runs,
        "s2t/entropy_threshold",
        "tau_h: entropy quantile of the candidates (nats)",
        y_floor=0.0,
        absent=absent,
        undefined_label="no candidates, so no tau_h",
    )
    return fraction, threshold


@dataclass
class TokenBars:
    """One run's most frequent silenced tokens (from its dump), most frequent first, or a note saying why none."""

    title: str
    tokens: list[str]
    counts: list[int]
    note: str | None = None


def token_bars(run: RunLogs, limit: int = 15) -> TokenBars:
    """The bars of the top-silenced-tokens figure for one run. Token texts have their whitespace made visible."""
    written = len(run.silenced_tokens or [])
    if run.dump_stats is None:
        return TokenBars(run.label, [], [], note="no token dump: train with dump_silenced_tokens: true")
    silenced = run.dump_stats.get("silenced", written)
    title = f"{run.label}\n{written} dumped of {silenced} silenced"
    top = top_silenced_tokens(run, limit)
    distinct = len({record["token"] for record in run.silenced_tokens or []})
    if distinct > len(top):
        title += f"; {len(top)} of {distinct} distinct tokens, most frequent first"
    if not top:
        steps = len(run.dump_stats.get("steps", [])) or max(record["step"] for record in run.history)
        candidates = summarize_run(run).get("candidates")
        detail = f", {candidates} candidates" if candidates is not None else ""
        return TokenBars(title, [], [], note=f"no token was silenced in {steps} steps{detail}")
    return TokenBars(title, [visible_token(text) for text, _ in top], [count for _, count in top])


@dataclass
class DensityPanel:
    """One run's p-H density of positive-advantage loss tokens, with the S2T region and the dumped silenced tokens.

    ``counts[i][j]`` is the number of tokens in bin i of log10 p and bin j of H over ``extent``
    ``(log10 p low, high, H low, high)``. ``masked_box`` is ``(log10 prob_threshold, median tau_h)`` when the run had
    candidates; ``threshold_only`` is ``log10 prob_threshold`` when it had none. ``silenced`` holds the dumped
    silenced tokens as ``(log10 p, H)``, clamped into the extent.
    """

    title: str
    counts: list[list[int]] | None = None
    extent: tuple[float, float, float, float] | None = None
    masked_box: tuple[float, float] | None = None
    threshold_only: float | None = None
    silenced: list[tuple[float, float]] = field(default_factory=list)
    note: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(map(sum, self.counts)) if self.counts else 0


def density_panel(run: RunLogs) -> DensityPanel:
    """The p-H density panel of one run (see :class:`DensityPanel`)."""
    if run.dump_stats is None:
        return DensityPanel(run.label, note="no token dump:\ntrain with dump_silenced_tokens: true")
    stats = run.dump_stats
    extent = tuple(float(value) for value in _density_extent(stats))
    panel = DensityPanel(run.label, counts=stats["density"]["positive_advantage"], extent=extent)
    if panel.num_tokens == 0:
        panel.note = "no completion token had a positive advantage"
    prob_threshold = stats.get("prob_threshold")
    threshold_series = metric_series(run.history, "s2t/entropy_threshold", run.label)
    thresholds = [value for _, value in threshold_series.defined] if threshold_series is not None else []
    if prob_threshold and thresholds:
        panel.masked_box = (math.log10(prob_threshold), statistics.median(thresholds))
    elif prob_threshold:
        panel.threshold_only = math.log10(prob_threshold)
    x_low, _, _, y_high = extent
    panel.silenced = [
        (max(x_low, math.log10(max(record["p"], 1e-300))), min(y_high, record["entropy"]))
        for record in run.silenced_tokens or []
    ]
    return panel


# ------------------------------------------------------------------------------------------------- drawing
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)
    return path


def draw_line_panel(axis, panel: LinePanel) -> None:
    """Draw a :class:`LinePanel`: lines broken at undefined steps, those steps marked on the x axis, notes inside."""
    import numpy as np

    marked_undefined = False
    for series in panel.series:
        values = np.array([np.nan if value is None else value for value in series.values], dtype=float)
        (line,) = axis.plot(series.steps, values, marker="o", markersize=3, linewidth=1.5, label=series.label)
        if series.band is not None:
            low, high = (np.array([np.nan if v is None else v for v in edge], dtype=float) for edge in series.band)
            if panel.y_floor is not None:
                low = np.maximum(low, panel.y_floor)
            axis.fill_between(series.steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        undefined = series.undefined_steps
        if undefined:
            label = panel.undefined_label if not marked_undefined else None
            axis.plot(
                undefined,
                [0.04] * len(undefined),
                linestyle="none",
                marker="x",
                markersize=7,
                markeredgewidth=1.5,
                color=line.get_color(),
                transform=axis.get_xaxis_transform(),
                label=label,
            )
            marked_undefined = True
    if panel.y_floor is not None:
        bottom, top = axis.get_ylim()
        axis.set_ylim(panel.y_floor, max(top, panel.y_floor + 1e-3))
    title = panel.title
    if panel.notes and any(series.defined for series in panel.series):
        title += "\n" + "; ".join(panel.notes)
    elif panel.notes:
        axis.text(0.5, 0.5, "\n".join(panel.notes), ha="center", va="center", fontsize=9, transform=axis.transAxes)
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("optimizer step")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc="best")


def plot_metric(runs: list[RunLogs], key: str, label: str, path: Path, y_floor: float | None = None) -> Path:
    """One metric over the steps, one line per run, on shared axes."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    draw_line_panel(axis, line_panel(runs, key, label, y_floor=y_floor))
    return _save(figure, path)


def plot_masking(runs: list[RunLogs], path: Path) -> Path:
    """The S2T masked fraction (%) and ``tau_h`` over the steps, one line per run."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    for axis, panel in zip(axes, masking_panels(runs), strict=True):
        draw_line_panel(axis, panel)
    return _save(figure, path)


def _density_extent(stats: dict[str, Any]) -> tuple[float, float, float, float]:
    density = stats["density"]
    return (*density["log10_p_range"], *density["entropy_range"])


def _populated_limits(stats: dict[str, Any]) -> tuple[float, float] | None:
    """The lowest log10 p and the highest H worth showing: the populated bins plus a margin."""
    import numpy as np

    counts = np.array(stats["density"]["positive_advantage"]) + np.array(stats["density"]["other"])
    if counts.sum() == 0:
        return None
    x_low, x_high, y_low, y_high = _density_extent(stats)
    rows, columns = np.nonzero(counts)
    x_width = (x_high - x_low) / counts.shape[0]
    y_width = (y_high - y_low) / counts.shape[1]
    lowest_p = x_low + rows.min() * x_width - 2 * x_width
    if stats.get("prob_threshold"):
        lowest_p = min(lowest_p, math.log10(stats["prob_threshold"]) - 2 * x_width)
    return max(x_low, lowest_p), min(y_high, y_low + (columns.max() + 1) * y_width * 1.15 + y_width)


def plot_token_density(runs: list[RunLogs], path: Path) -> Path:
    """Where the positive-advantage loss tokens sit over (log10 p, H), per run on shared axes, with the S2T masked
    region (``p < prob_threshold`` and ``H < tau_h``, the run's median ``tau_h``) and the dumped silenced tokens."""
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    figure, axes = plt.subplots(
        1, len(runs), figsize=(5.2 * len(runs), 4.2), sharex=True, sharey=True, constrained_layout=True, squeeze=False
    )
    for axis, run in zip(axes[0], runs, strict=True):
        panel = density_panel(run)
        axis.set_title(panel.title, fontsize=10)
        axis.set_xlabel("log10 p (probability of the sampled token)")
        if panel.note:
            axis.text(0.5, 0.5, panel.note, ha="center", va="center", transform=axis.transAxes, fontsize=9)
        if panel.counts is None:
            continue
        counts = np.array(panel.counts, dtype=float)
        x_low, x_high, y_low, y_high = panel.extent
        if counts.sum() > 0:
            image = axis.imshow(
                np.ma.masked_equal(counts.T, 0),
                origin="lower",
                extent=panel.extent,
                aspect="auto",
                norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)),
                cmap="viridis",
            )
            figure.colorbar(image, ax=axis, label="tokens (A > 0)")
        if panel.masked_box is not None:
            log10_threshold, tau_h = panel.masked_box
            axis.add_patch(
                Rectangle(
                    (x_low, y_low),
                    log10_threshold - x_low,
                    tau_h - y_low,
                    fill=False,
                    edgecolor="red",
                    linestyle="--",
                    linewidth=1.5,
                    label=f"masked: p < {10**log10_threshold:.3g}, H < {tau_h:.2f}\n(the median of the per-step tau_h)",
                )
            )
        elif panel.threshold_only is not None:
            axis.axvline(panel.threshold_only, color="red", linestyle="--", linewidth=1.2)
            axis.plot(
                [],
                [],
                color="red",
                linestyle="--",
                label=f"p = {10**panel.threshold_only:.3g}; no candidates, no tau_h",
            )
        if panel.silenced:
            x, y = zip(*panel.silenced, strict=True)
            axis.scatter(x, y, s=14, marker="x", color="red", linewidths=1.0, label="silenced (dumped)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("H: entropy at the position (nats)")
    limits = [_populated_limits(run.dump_stats) for run in runs if run.dump_stats is not None]
    limits = [limit for limit in limits if limit is not None]
    if limits:
        axes[0][0].set_xlim(min(limit[0] for limit in limits), 0.0)
        axes[0][0].set_ylim(0.0, max(limit[1] for limit in limits))
    figure.suptitle("Positive-advantage completion tokens over probability and entropy", fontsize=11)
    return _save(figure, path)


def plot_top_silenced(runs: list[RunLogs], path: Path, limit: int = 15) -> Path:
    """The most frequent silenced tokens of each run's dump, as horizontal bars, or the reason there are none."""
    plt = _pyplot()
    figure, axes = plt.subplots(
        1, len(runs), figsize=(4.6 * len(runs), 0.3 * limit + 1.6), constrained_layout=True, squeeze=False
    )
    for axis, run in zip(axes[0], runs, strict=True):
        bars = token_bars(run, limit)
        axis.set_title(bars.title, fontsize=10)
        if bars.note:
            axis.text(0.5, 0.5, bars.note, ha="center", va="center", transform=axis.transAxes, fontsize=9)
            axis.set_xticks([])
            axis.set_yticks([])
            continue
        positions = range(len(bars.tokens))
        axis.barh(positions, bars.counts, color="tab:red")
        axis.set_yticks(positions, bars.tokens, fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("times silenced (in the dump)")
        axis.xaxis.get_major_locator().set_params(integer=True)
    return _save(figure, path)


# ------------------------------------------------------------------------------------------------- report
@dataclass
class Report:
    """The files a report wrote, and its per-run summaries."""

    output_dir: Path
    figures: dict[str, Path]
    markdown: Path
    summaries: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    html: Path | None = None


def _cell(value: Any, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def _summary_table(summaries: list[dict[str, Any]]) -> str:
    header = (
        "| run | steps | reward (first → last quarter) | entropy (first → last quarter) | masked fraction | "
        "masked tokens | candidates | median tau_h | dump written / silenced |"
    )
    lines = [header, "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for s in summaries:
        reward = (
            f"{s['reward_first_quarter']:+.3f} → {s['reward_last_quarter']:+.3f}"
            if "reward_first_quarter" in s
            else "–"
        )
        entropy = (
            f"{s['entropy_first_quarter']:.3f} → {s['entropy_last_quarter']:.3f}"
            if "entropy_first_quarter" in s
            else "–"
        )
        masked = _cell(s.get("masked_fraction"), "{:.4%}")
        dump = f"{s['dump_written']} / {s['dump_silenced']}" if "dump_written" in s else "–"
        lines.append(
            f"| {s['label']} | {s['steps']} | {reward} | {entropy} | {masked} | {_cell(s.get('masked_tokens'), '{}')} "
            f"| {_cell(s.get('candidates'), '{}')} | {_cell(s.get('tau_h_median'), '{:.3f}')} | {dump} |"
        )
    return "\n".join(lines)


def _unique_labels(directories: list[Path], labels: list[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(directories):
            raise ReportError(f"--labels gives {len(labels)} labels for {len(directories)} run directories.")
        return labels
    names = [directory.resolve().name for directory in directories]
    if len(set(names)) == len(names):
        return names
    return [f"{directory.resolve().parent.name}/{directory.resolve().name}" for directory in directories]


def write_report(
    run_dirs: list[str | Path],
    output_dir: str | Path,
    *,
    labels: list[str] | None = None,
    html: bool = False,
    top_tokens: int = 15,
) -> Report:
    """Read the runs, draw the figures into ``output_dir`` and write ``report.md`` (and ``report.html``)."""
    if not run_dirs:
        raise ReportError("Give at least one run directory.")
    directories = [Path(directory) for directory in run_dirs]
    runs = [
        load_run(directory, label)
        for directory, label in zip(directories, _unique_labels(directories, labels), strict=True)
    ]
    output_dir = Path(output_dir)
    figures = {
        "entropy": plot_metric(
            runs, "entropy", "mean token entropy (nats)", output_dir / FIGURES["entropy"], y_floor=0.0
        ),
        "reward": plot_metric(runs, "reward", "mean reward", output_dir / FIGURES["reward"]),
        "masking": plot_masking(runs, output_dir / FIGURES["masking"]),
    }
    notes = []
    with_dump = [run for run in runs if run.dump_stats is not None]
    if with_dump:
        figures["token_density"] = plot_token_density(runs, output_dir / FIGURES["token_density"])
        figures["top_silenced_tokens"] = plot_top_silenced(
            runs, output_dir / FIGURES["top_silenced_tokens"], top_tokens
        )
    else:
        notes.append(
            "No run has a silenced-token dump, so the p-H density and the top silenced tokens are left out. Train with "
            "`dump_silenced_tokens: true` to get them."
        )
    for run in runs:
        if not any("s2t/masked_fraction" in record for record in run.history):
            notes.append(f"{run.label}: no S2T statistics in the log (the run did not use the S2T mask).")

    summaries = [summarize_run(run) for run in runs]
    markdown = output_dir / REPORT_FILE
    markdown.write_text(_markdown(runs, summaries, notes, figures, lambda path: path.name))
    report = Report(output_dir=output_dir, figures=figures, markdown=markdown, summaries=summaries, notes=notes)
    if html:
        report.html = output_dir / HTML_FILE
        report.html.write_text(_html(_markdown(runs, summaries, notes, figures, _data_uri)))
    return report


FIGURE_TITLES = {
    "entropy": "Mean token entropy",
    "reward": "Reward",
    "masking": "S2T masked fraction and tau_h",
    "token_density": "Probability and entropy of positive-advantage tokens",
    "top_silenced_tokens": "Top silenced tokens",
}


def silenced_token_line(record: dict[str, Any], context: int = 60, code: bool = True) -> str:
    """One dumped silenced token in its context, with p, H and the response's advantage; as inline Markdown code
    when `code`, else as plain text. Line breaks in the context show as ↵, the token's whitespace as ␣."""
    before = record["context_before"][-context:].replace("`", "'").replace("\n", "↵")
    after = record["context_after"][:context].replace("`", "'").replace("\n", "↵")
    token = visible_token(record["token"]).replace("`", "'")
    text = f"…{before}[[{token}]]{after}…"
    return f"step {record['step']}, p {record['p']:.2g}, H {record['entropy']:.2f}, A {record['advantage']:+.2f}: " + (
        f"`{text}`" if code else text
    )


def _markdown(
    runs: list[RunLogs],
    summaries: list[dict[str, Any]],
    notes: list[str],
    figures: dict[str, Path],
    image_source,
) -> str:
    lines = ["# stapo-trl report", ""]
    for run, summary in zip(runs, summaries, strict=True):
        lines.append(
            f"- **{run.label}**: `{run.directory}` (log: `{run.source.name}`); entropy {entropy_trend(summary)}"
        )
    lines += ["", _summary_table(summaries), ""]
    lines += [f"> {note}\n" for note in notes]
    for name, path in figures.items():
        lines += ["", f"## {FIGURE_TITLES[name]}", "", f"![{FIGURE_TITLES[name]}]({image_source(path)})"]
    with_dump = [run for run in runs if run.dump_stats is not None]
    if with_dump:
        lines += ["", "## Silenced tokens in context", ""]
        for run in with_dump:
            examples = (run.silenced_tokens or [])[:5]
            lines.append(f"**{run.label}**" + ("" if examples else ": none dumped"))
            lines.append("")
            lines += [f"- {silenced_token_line(record)}" for record in examples]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _data_uri(path: Path) -> str:
    return f"data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"


HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
    "table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px}"
    "th{background:#f3f3f3}code{background:#f6f6f6;padding:1px 3px}img{max-width:100%}"
    "blockquote{color:#555;border-left:3px solid #ccc;margin-left:0;padding-left:1em}"
)


def _html(markdown_text: str) -> str:
    """A standalone HTML page of the report's Markdown (tables included), rendered with Python-Markdown."""
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables"])
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>stapo-trl report</title>"
        f"<style>{HTML_STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )
