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

from ..resume import TRAINER_STATE_FILE, last_complete_checkpoint
from .token_dump import DUMP_STATS_FILE, SILENCED_TOKENS_FILE

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.md"
HTML_FILE = "report.html"

FIGURES = {
    "entropy": "entropy.png",
    "reward": "reward.png",
    "masking": "masking.png",
    "token_density": "token_density.png",
    "top_silenced_tokens": "top_silenced_tokens.png",
}


class ReportError(ValueError):
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

    if source.name == METRICS_FILE:
        records = read_metrics(source)
    else:
        records = json.loads(source.read_text()).get("log_history", [])
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
    records_path, stats_path = directory / SILENCED_TOKENS_FILE, directory / DUMP_STATS_FILE
    if stats_path.is_file():
        run.dump_stats = json.loads(stats_path.read_text())
    if records_path.is_file():
        run.silenced_tokens = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    return run


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


# ------------------------------------------------------------------------------------------------- figures
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


def _line_panel(axis, runs: list[RunLogs], key: str, scale: float = 1.0) -> bool:
    drew = False
    for run in runs:
        steps, values = series(run.history, key, scale)
        if steps:
            axis.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label=run.label)
            drew = True
    if not drew:
        axis.text(0.5, 0.5, f"{key} was not logged", ha="center", va="center", transform=axis.transAxes)
    axis.set_xlabel("optimizer step")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.grid(alpha=0.3)
    if drew and len(runs) > 1:
        axis.legend(fontsize=8)
    return drew


def plot_metric(runs: list[RunLogs], key: str, label: str, path: Path) -> Path:
    """One metric over the steps, one line per run, on shared axes."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    _line_panel(axis, runs, key)
    axis.set_title(label, fontsize=10)
    return _save(figure, path)


def plot_masking(runs: list[RunLogs], path: Path) -> Path:
    """The S2T masked fraction (%) and ``tau_h`` over the steps, one line per run."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    _line_panel(axes[0], runs, "s2t/masked_fraction", scale=100.0)
    axes[0].set_title("S2T masked fraction of loss tokens (%)", fontsize=10)
    _line_panel(axes[1], runs, "s2t/entropy_threshold")
    axes[1].set_title("tau_h: entropy threshold of the candidates (nats)", fontsize=10)
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
        axis.set_title(run.label, fontsize=10)
        axis.set_xlabel("log10 p (probability of the sampled token)")
        if run.dump_stats is None:
            axis.text(
                0.5,
                0.5,
                "no token dump:\ntrain with dump_silenced_tokens=True",
                ha="center",
                va="center",
                transform=axis.transAxes,
            )
            continue
        counts = np.array(run.dump_stats["density"]["positive_advantage"], dtype=float)
        x_low, x_high, y_low, y_high = _density_extent(run.dump_stats)
        if counts.sum() > 0:
            image = axis.imshow(
                np.ma.masked_equal(counts.T, 0),
                origin="lower",
                extent=(x_low, x_high, y_low, y_high),
                aspect="auto",
                norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)),
                cmap="viridis",
            )
            figure.colorbar(image, ax=axis, label="tokens (A > 0)")
        prob_threshold = run.dump_stats.get("prob_threshold")
        _, thresholds = series(run.history, "s2t/entropy_threshold")
        if prob_threshold and thresholds:
            tau_h = statistics.median(thresholds)
            axis.add_patch(
                Rectangle(
                    (x_low, y_low),
                    math.log10(prob_threshold) - x_low,
                    tau_h - y_low,
                    fill=False,
                    edgecolor="red",
                    linestyle="--",
                    linewidth=1.5,
                    label=f"masked: p < {prob_threshold:g}, H < {tau_h:.2f} (median tau_h)",
                )
            )
        elif prob_threshold:
            axis.axvline(math.log10(prob_threshold), color="red", linestyle="--", linewidth=1.2)
            axis.plot([], [], color="red", linestyle="--", label=f"p = {prob_threshold:g}; no candidates, no tau_h")
        if run.silenced_tokens:
            x = [max(x_low, math.log10(max(record["p"], 1e-300))) for record in run.silenced_tokens]
            y = [min(y_high, record["entropy"]) for record in run.silenced_tokens]
            axis.scatter(x, y, s=10, marker="x", color="red", linewidths=0.8, label="silenced (dumped)")
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
    """The most frequent silenced tokens of each run's dump, as horizontal bars."""
    plt = _pyplot()
    figure, axes = plt.subplots(
        1, len(runs), figsize=(4.6 * len(runs), 0.3 * limit + 1.6), constrained_layout=True, squeeze=False
    )
    for axis, run in zip(axes[0], runs, strict=True):
        top = top_silenced_tokens(run, limit)
        written = len(run.silenced_tokens or [])
        silenced = (run.dump_stats or {}).get("silenced", written)
        axis.set_title(f"{run.label}\n{written} dumped of {silenced} silenced", fontsize=10)
        if not top:
            reason = "no token dump" if run.dump_stats is None else "no token was silenced"
            axis.text(0.5, 0.5, reason, ha="center", va="center", transform=axis.transAxes)
            axis.set_yticks([])
            continue
        labels = [visible_token(text) for text, _ in reversed(top)]
        axis.barh(range(len(top)), [count for _, count in reversed(top)], color="tab:red")
        axis.set_yticks(range(len(top)), labels, fontsize=8)
        axis.set_xlabel("times silenced (in the dump)")
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
        "entropy": plot_metric(runs, "entropy", "mean token entropy (nats)", output_dir / FIGURES["entropy"]),
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
    lines = ["# stapo-trl report", ""]
    for run, summary in zip(runs, summaries, strict=True):
        lines.append(
            f"- **{run.label}**: `{run.directory}` (log: `{run.source.name}`); entropy {entropy_trend(summary)}"
        )
    lines += ["", _summary_table(summaries), ""]
    lines += [f"> {note}" for note in notes]
    titles = {
        "entropy": "Mean token entropy",
        "reward": "Reward",
        "masking": "S2T masked fraction and tau_h",
        "token_density": "Probability and entropy of positive-advantage tokens",
        "top_silenced_tokens": "Top silenced tokens",
    }
    for name, path in figures.items():
        lines += ["", f"## {titles[name]}", "", f"![{titles[name]}]({path.name})"]
    if with_dump:
        lines += ["", "## Silenced tokens in context", ""]
        for run in with_dump:
            examples = (run.silenced_tokens or [])[:5]
            lines.append(f"**{run.label}**" + ("" if examples else ": none dumped"))
            lines.append("")
            for record in examples:
                lines.append(
                    f"- step {record['step']}, p {record['p']:.2g}, H {record['entropy']:.2f}, A {record['advantage']:+.2f}: "
                    f"`…{record['context_before'][-60:]}[[{record['token']}]]{record['context_after'][:60]}…`"
                )
            lines.append("")
    markdown = output_dir / REPORT_FILE
    markdown.write_text("\n".join(lines).rstrip() + "\n")
    report = Report(output_dir=output_dir, figures=figures, markdown=markdown, summaries=summaries, notes=notes)
    if html:
        report.html = _write_html(lines, figures, output_dir / HTML_FILE)
    return report


def _write_html(markdown_lines: list[str], figures: dict[str, Path], path: Path) -> Path:
    """A standalone HTML page: the Markdown text in a <pre> block (tables included) and the figures inlined."""
    import html as html_escape

    text = "\n".join(line for line in markdown_lines if not line.startswith("!["))
    images = "\n".join(
        f'<h2>{html_escape.escape(name)}</h2><img alt="{html_escape.escape(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(figure.read_bytes()).decode()}">'
        for name, figure in figures.items()
    )
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>stapo-trl report</title></head><body>"
        f"<pre>{html_escape.escape(text)}</pre>{images}</body></html>\n"
    )
    return path
