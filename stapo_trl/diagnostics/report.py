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
from ..files import read_json_file
from ..jsonl import read_json_lines
from ..names import METRICS_FILE, SILENCED_TOKENS_FILE, SILENCED_TOKENS_STATS_FILE, TRAINER_STATE_FILE
from ..resume import last_complete_checkpoint
from ..token_rules import TOKEN_RULES, TokenRuleSpec
from .plotting import (
    DensityPanel,
    LinePanel,
    Series,
    TokenBars,
    plot_density_panels,
    plot_line_panels,
    plot_token_bars,
    populated_density_limits,
)

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


def read_metrics(path: str | Path) -> list[dict]:
    """The training records of a `metrics.jsonl` file (the final summary record is left out; a last line cut off
    mid-write is left out with a warning)."""
    return [record for record in read_json_lines(path) if "train_runtime" not in record]


def read_history(source: Path) -> list[dict[str, Any]]:
    """The per-step training records of a ``trainer_state.json`` or ``metrics.jsonl`` (the end-of-training summary
    record, which has ``train_runtime``, is left out)."""
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
        run.dump_stats = read_json_file(
            stats_path,
            "the silenced-token dump's counts and density",
            "Point the report at a checkpoint-N/ of the run, whose copy was saved with it, or delete the file to "
            "report without the dump's figures.",
        )
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


def silencing_rule(history: list[dict[str, Any]]) -> TokenRuleSpec | None:
    """The rule whose silenced tokens the report shows: the first registered rule, in apply order, that logged a
    ``silenced_fraction``; None when no rule did."""
    for spec in sorted(TOKEN_RULES.values(), key=lambda spec: spec.order):
        if any(spec.metric("silenced_fraction") in record for record in history):
            return spec
    return None


def _candidates_metric(spec: TokenRuleSpec | None) -> str | None:
    if spec is None or spec.report is None or spec.report.candidates_statistic is None:
        return None
    return spec.metric(spec.report.candidates_statistic)


def _threshold_metric(spec: TokenRuleSpec | None) -> str | None:
    if spec is None or spec.report is None or spec.report.threshold_statistic is None:
        return None
    return spec.metric(spec.report.threshold_statistic)


def summarize_run(run: RunLogs) -> dict[str, Any]:
    """The numbers the report's table shows for one run."""
    summary: dict[str, Any] = {"label": run.label, "steps": max(record["step"] for record in run.history)}
    for key, name in (("reward", "reward"), ("entropy", "entropy")):
        means = quarter_means(series(run.history, key)[1])
        if means is not None:
            summary[f"{name}_first_quarter"], summary[f"{name}_last_quarter"] = means
    spec = silencing_rule(run.history)
    if spec is not None:
        summary["silencing_rule"] = spec.name
        _, silenced = series(run.history, spec.metric("silenced_fraction"))
        if silenced:
            summary["silenced_fraction"] = sum(silenced) / len(silenced)
        summary["silenced_tokens"] = int(sum(series(run.history, spec.metric("num_silenced"))[1]))
        candidates = _candidates_metric(spec)
        if candidates is not None:
            summary["candidates"] = int(sum(series(run.history, candidates)[1]))
    threshold = _threshold_metric(spec)
    thresholds = series(run.history, threshold)[1] if threshold is not None else []
    if thresholds:
        summary["threshold_median"] = statistics.median(thresholds)
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
# What each figure shows, as the data classes of plotting.py (which draws them); the tests pin these.


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
    """The silenced fraction (%) of each run's silencing rule and that rule's threshold (S2T's ``tau_h``) over the
    steps. The legend of the first says how many tokens each run silenced of how many candidates; the titles name
    the rules."""
    absent = "no token rule silenced tokens (none was on)"
    fraction = LinePanel(title="", series=[], y_floor=0.0)
    threshold = LinePanel(title="", series=[], y_floor=0.0)
    rules, thresholds = [], []
    by_label = {run.label: summarize_run(run) for run in runs}
    for run in runs:
        spec = silencing_rule(run.history)
        found = metric_series(run.history, spec.metric("silenced_fraction"), run.label, 100.0) if spec else None
        if found is None:
            fraction.notes.append(f"{run.label}: {absent}")
            threshold.notes.append(f"{run.label}: {absent}")
            continue
        if spec.display_name not in rules:
            rules.append(spec.display_name)
        summary = by_label[run.label]
        if found.defined and all(value == 0.0 for _, value in found.defined):
            fraction.notes.append(f"{run.label}: 0% at every step")
        counted = f"{summary['silenced_tokens']} silenced"
        if "candidates" in summary:
            counted = f"{summary['silenced_tokens']} of {summary['candidates']} {spec.report.candidates_noun} silenced"
        found.label = f"{run.label}: {counted}"
        fraction.series.append(found)
        metric = _threshold_metric(spec)
        line = metric_series(run.history, metric, run.label) if metric is not None else None
        if line is None:
            threshold.notes.append(f"{run.label}: {spec.display_name} has no threshold")
            continue
        threshold.series.append(line)
        threshold.undefined_label = f"no {spec.report.candidates_noun}, so no {spec.report.threshold_name}"
        if spec.report.threshold_title not in thresholds:
            thresholds.append(spec.report.threshold_title)
    fraction.title = f"{', '.join(rules) or 'token rule'} silenced fraction of loss tokens (%)"
    threshold.title = "; ".join(thresholds) or "threshold of the silencing rule"
    if threshold.series and not any(series.defined for series in threshold.series):
        threshold.notes.append(f"{threshold.undefined_label} at every logged step")
    return fraction, threshold


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
        title += f"\n{len(top)} of {distinct} distinct tokens, most frequent first"
    if not top:
        steps = len(run.dump_stats.get("steps", [])) or max(record["step"] for record in run.history)
        candidates = summarize_run(run).get("candidates")
        detail = f", {candidates} candidates" if candidates is not None else ""
        return TokenBars(title, [], [], note=f"no token was silenced in {steps} steps{detail}")
    return TokenBars(title, [visible_token(text) for text, _ in top], [count for _, count in top])


def density_panel(run: RunLogs) -> DensityPanel:
    """The p-H density panel of one run (see :class:`DensityPanel`)."""
    if run.dump_stats is None:
        return DensityPanel(run.label, note="no token dump:\ntrain with dump_silenced_tokens: true")
    stats = run.dump_stats
    extent = tuple(float(value) for value in _density_extent(stats))
    panel = DensityPanel(run.label, counts=stats["density"]["positive_advantage"], extent=extent)
    if panel.num_tokens == 0:
        panel.note = "no completion token had a positive advantage"
    probability_bound = stats.get("probability_bound")
    metric = _threshold_metric(silencing_rule(run.history))
    threshold_series = metric_series(run.history, metric, run.label) if metric is not None else None
    thresholds = [value for _, value in threshold_series.defined] if threshold_series is not None else []
    if probability_bound and thresholds:
        panel.silenced_box = (math.log10(probability_bound), statistics.median(thresholds))
    elif probability_bound:
        panel.threshold_only = math.log10(probability_bound)
    x_low, _, _, y_high = extent
    panel.silenced = [
        (max(x_low, math.log10(max(record["p"], 1e-300))), min(y_high, record["entropy"]))
        for record in run.silenced_tokens or []
    ]
    return panel


# ------------------------------------------------------------------------------------------------- figures
TRAINING_CURVES = (
    ("reward", "mean reward", None, 1.0),
    ("entropy", "mean token entropy (nats)", 0.0, 1.0),
)
"""(metric, title, lowest value the axis shows, scale) of the first panels of ``training_curves.png``; the last is
the silenced fraction of the run's silencing rule."""


def training_curve_panels(records: list[dict], label: str = "run") -> list[LinePanel]:
    """The panels of ``training_curves.png`` (reward, entropy, silenced fraction) of one run's records."""
    panels = []
    spec = silencing_rule(records)
    silenced = (
        (spec.metric("silenced_fraction"), f"{spec.name} silenced fraction (%)", 0.0, 100.0)
        if spec is not None
        else ("silenced_fraction", "silenced fraction (%)", 0.0, 100.0)
    )
    for key, title, y_floor, scale in (*TRAINING_CURVES, silenced):
        found = metric_series([record for record in records if "step" in record], key, label, scale)
        panel = LinePanel(title=title, series=[found] if found is not None else [], y_floor=y_floor)
        if found is None:
            panel.notes.append("not logged by this run")
        panels.append(panel)
    return panels


def plot_training_curves(records: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Write a three-panel PNG of reward, entropy and silenced fraction against the step. A metric that the run did
    not log (for example the mask of a GRPO run) leaves its panel with a note."""
    return plot_line_panels(training_curve_panels(records), path, panel_size=(4.2, 3.2), title=title, dpi=110)


def plot_metric(runs: list[RunLogs], key: str, label: str, path: Path, y_floor: float | None = None) -> Path:
    """One metric over the steps, one line per run, on shared axes."""
    return plot_line_panels([line_panel(runs, key, label, y_floor=y_floor)], path, panel_size=(6, 3.6))


def plot_masking(runs: list[RunLogs], path: Path) -> Path:
    """The silenced fraction (%) and the silencing rule's threshold over the steps, one line per run."""
    return plot_line_panels(masking_panels(runs), path, panel_size=(5.5, 3.8))


def _density_extent(stats: dict[str, Any]) -> tuple[float, float, float, float]:
    density = stats["density"]
    return (*density["log10_p_range"], *density["entropy_range"])


def density_limits(runs: list[RunLogs]) -> tuple[float, float] | None:
    """The lowest log10 p and highest H that the runs' populated density bins reach (all tokens, any advantage)."""
    limits = []
    for run in runs:
        if run.dump_stats is None:
            continue
        density = run.dump_stats["density"]
        counts = [
            [a + b for a, b in zip(row_a, row_b, strict=True)]
            for row_a, row_b in zip(density["positive_advantage"], density["other"], strict=True)
        ]
        found = populated_density_limits(
            counts, _density_extent(run.dump_stats), run.dump_stats.get("probability_bound")
        )
        if found is not None:
            limits.append(found)
    if not limits:
        return None
    return min(limit[0] for limit in limits), max(limit[1] for limit in limits)


def plot_token_density(runs: list[RunLogs], path: Path) -> Path:
    """Where the positive-advantage loss tokens sit over (log10 p, H), per run on shared axes, with the silencing
    region of the run's rule (for S2T ``p < prob_threshold`` and ``H < tau_h``, the run's median ``tau_h``) and the
    dumped silenced tokens."""
    return plot_density_panels(
        [density_panel(run) for run in runs],
        path,
        limits=density_limits(runs),
        title="Positive-advantage completion tokens over probability and entropy",
    )


def plot_top_silenced(runs: list[RunLogs], path: Path, limit: int = 15) -> Path:
    """The most frequent silenced tokens of each run's dump, as horizontal bars, or the reason there are none."""
    return plot_token_bars([token_bars(run, limit) for run in runs], path, limit)


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
        "| run | steps | reward (first → last quarter) | entropy (first → last quarter) | silenced fraction | "
        "silenced tokens | candidates | median threshold | dump written / silenced |"
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
        silenced = f"{_cell(s.get('silenced_fraction'), '{:.4%}')} | {_cell(s.get('silenced_tokens'), '{}')}"
        dump = f"{s['dump_written']} / {s['dump_silenced']}" if "dump_written" in s else "–"
        lines.append(
            f"| {s['label']} | {s['steps']} | {reward} | {entropy} | {silenced} "
            f"| {_cell(s.get('candidates'), '{}')} | {_cell(s.get('threshold_median'), '{:.3f}')} | {dump} |"
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
        if silencing_rule(run.history) is None:
            notes.append(f"{run.label}: no token rule silenced tokens in the log (none was on).")

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
    "masking": "Silenced fraction and the silencing threshold",
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
