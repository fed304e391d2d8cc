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
from ..names import (
    METRICS_FILE,
    SHADOW_PREFIX,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    TRAINER_STATE_FILE,
)
from ..resume import last_complete_checkpoint
from ..storage import read_json_file, read_json_lines
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
from .trends import finite_series, is_training_record, quarter_means, run_trends  # noqa: F401 (quarter_means is re-exported)

REPORT_FILE = "report.md"
HTML_FILE = "report.html"

FIGURES = {
    "entropy": "entropy.png",
    "reward": "reward.png",
    "masking": "masking.png",
    "optimization": "optimization.png",
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
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    """The log's evaluation records (``eval_*`` keys), such as the held-out accuracy of `stapo-trl train`."""


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
    record, which has ``train_runtime``, and the evaluation records, with ``eval_*`` keys, are left out)."""
    return [record for record in read_log(source) if "step" in record and is_training_record(record)]


def read_evaluations(source: Path) -> list[dict[str, Any]]:
    """The evaluation records (``eval_*`` keys) of a ``trainer_state.json`` or ``metrics.jsonl``."""
    return [record for record in read_log(source) if "step" in record and any(k.startswith("eval_") for k in record)]


def read_log(source: Path) -> list[dict[str, Any]]:
    """Every record of a ``trainer_state.json``'s log history or of a ``metrics.jsonl``."""
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
    return records


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
    run.evaluations = read_evaluations(source)
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


def training_records(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a log that are training steps: not evaluation records, not the end-of-training summary."""
    return [record for record in history if is_training_record(record)]


HELDOUT_ACCURACY = "eval_heldout_accuracy"
HELDOUT_STANDARD_ERROR = "eval_heldout_accuracy_standard_error"
HELDOUT_FORMAT_RATE = "eval_heldout_format_rate"
HELDOUT_TOTAL = "eval_heldout_total"

OPTIMIZATION_METRICS = (
    ("grad_norm", "gradient norm before clipping", 0.0, 1.0),
    ("completions/mean_length", "mean completion length (tokens)", 0.0, 1.0),
    ("clip_ratio/region_mean", "share of tokens clipped (%)", 0.0, 100.0),
    ("gradient_probe/silenced_grad_sq_share", "silenced tokens' share of |gradient|^2 (probe)", 0.0, 1.0),
)
"""(metric, title, lowest value the axis shows, scale) of ``optimization.png``: what the updates looked like."""


def heldout_accuracy(history: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The held-out greedy accuracy that `stapo-trl train` logged (``eval_heldout_*``): ``{"before": ..., "after":
    ...}`` from the evaluation record at step 0 and the last one, each with its accuracy, standard error, format
    rate, problem count and step; ``{}`` when none was logged."""
    logged = [record for record in history if _finite(record.get(HELDOUT_ACCURACY))]
    if not logged:
        return {}

    def entry(record):
        return {
            "accuracy": record[HELDOUT_ACCURACY],
            "standard_error": record.get(HELDOUT_STANDARD_ERROR),
            "format_rate": record.get(HELDOUT_FORMAT_RATE),
            "total": record.get(HELDOUT_TOTAL),
            "step": record.get("step"),
        }

    found = {}
    if logged[0].get("step") == 0:
        found["before"] = entry(logged[0])
    if logged[-1].get("step") != 0:
        found["after"] = entry(logged[-1])
    return found


def summarize_run(run: RunLogs) -> dict[str, Any]:
    """The numbers the report shows for one run."""
    steps = training_records(run.history)
    summary: dict[str, Any] = {"label": run.label, "steps": max(record["step"] for record in run.history)}
    trends = run_trends(steps)
    summary["trends"] = trends
    for key in ("reward", "entropy"):
        if key in trends:
            summary[f"{key}_first_quarter"] = trends[key].first_quarter
            summary[f"{key}_last_quarter"] = trends[key].last_quarter
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
    rule_lines = []
    shadow_view = shadow_records(steps)
    for rule in sorted(TOKEN_RULES.values(), key=lambda rule: rule.order):
        for records, prefix in ((steps, ""), (shadow_view, "in shadow (computed, not applied): ")):
            found = rule.summarize(records)
            if found:
                rule_lines += [prefix + " ".join(line.split()) for line in rule.summary_lines(found, len(steps))]
    summary["rule_lines"] = rule_lines
    grad_norms = finite_series(steps, "grad_norm")[1]
    if grad_norms:
        summary["grad_norm_median"], summary["grad_norm_max"] = statistics.median(grad_norms), max(grad_norms)
    for key, name in (
        ("completions/mean_length", "completion_length"),
        ("clip_ratio/region_mean", "clip_ratio"),
        ("gradient_probe/silenced_grad_sq_share", "probe_grad_sq_share"),
        ("gradient_probe/silenced_token_share", "probe_token_share"),
    ):
        values = finite_series(steps, key)[1]
        if values:
            summary[f"{name}_mean"] = sum(values) / len(values)
            summary[f"{name}_steps"] = len(values)
    summary["heldout"] = heldout_accuracy(run.evaluations)
    if run.dump_stats is not None:
        for key in ("silenced", "written", "dropped"):
            summary[f"dump_{key}"] = run.dump_stats[key]
    return summary


def shadow_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as a rule run in shadow logged them (``shadow/<rule>/<statistic>``), renamed to the names the rule
    logs when applied, so its spec can summarize them."""
    prefix = f"{SHADOW_PREFIX}/"
    return [
        {
            "step": record.get("step"),
            **{key[len(prefix) :]: value for key, value in record.items() if key.startswith(prefix)},
        }
        for record in records
    ]


def trend_sentences(summary: dict[str, Any]) -> list[str]:
    """The run's trends, as the same sentences the end-of-run summary and the model card print."""
    return [trend.sentence() for trend in summary.get("trends", {}).values()]


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
    the rules. A run whose rule ran in shadow (GRPO with ``shadow_token_rules: [s2t]``) is drawn with what the rule
    would have silenced, its label saying so."""
    absent = "no token rule silenced tokens (none was on)"
    fraction = LinePanel(title="", series=[], y_floor=0.0)
    threshold = LinePanel(title="", series=[], y_floor=0.0)
    rules, thresholds = [], []
    views = []
    for run in runs:
        shadow = shadow_records(run.history)
        if silencing_rule(run.history) is None and silencing_rule(shadow) is not None:
            run = RunLogs(f"{run.label} (in shadow, would silence)", run.directory, shadow, run.source)
        views.append(run)
    runs = views
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
    """The top-silenced-tokens panel of one run: bars of the most frequent token texts (whitespace made visible),
    or, when every shown token was silenced equally often (bars would all be one length), a table of the dumped
    tokens in their context with p, H and the advantage A."""
    written = len(run.silenced_tokens or [])
    if run.dump_stats is None:
        return TokenBars(run.label, [], [], note="no token dump: train with dump_silenced_tokens: true")
    silenced = run.dump_stats.get("silenced", written)
    title = f"{run.label}\n{written} dumped of {silenced} silenced"
    top = top_silenced_tokens(run, limit)
    distinct = len({record["token"] for record in run.silenced_tokens or []})
    if not top:
        steps = len(run.dump_stats.get("steps", [])) or max(record["step"] for record in run.history)
        candidates = summarize_run(run).get("candidates")
        detail = f", {candidates} candidates" if candidates is not None else ""
        return TokenBars(title, [], [], note=f"no token was silenced in {steps} steps{detail}")
    if len({count for _, count in top}) == 1:
        records = spread(run.silenced_tokens or [], limit)
        title += f"\n{distinct} distinct tokens, each silenced {top[0][1]} time{'s' if top[0][1] > 1 else ''}"
        if len(records) < written:
            title += f"; {len(records)} shown, spread over the run"
        return TokenBars(title, [], [], rows=[token_row(record) for record in records])
    if distinct > len(top):
        title += f"\n{len(top)} of {distinct} distinct tokens, most frequent first"
    return TokenBars(title, [visible_token(text) for text, _ in top], [count for _, count in top])


def spread(records: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` records spread evenly over the list (first and last included)."""
    if len(records) <= count:
        return list(records)
    return [records[round(index * (len(records) - 1) / (count - 1))] for index in range(count)]


def token_row(record: dict[str, Any], context: int = 24) -> tuple[str, ...]:
    """One dumped silenced token as a table row: step, the token in its context, p, H and A."""
    before = record["context_before"][-context:].replace("\n", "↵")
    after = record["context_after"][:context].replace("\n", "↵")
    return (
        str(record["step"]),
        f"…{before}[{visible_token(record['token'])}]{after}…",
        f"{record['p']:.2g}",
        f"{record['entropy']:.2f}",
        f"{record['advantage']:+.2f}",
    )


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
"""(metric, title, lowest value the axis shows, scale) of the first panels of ``training_curves.png``; then come the
gradient norm and the silenced fraction of the run's silencing rule."""


def training_curve_panels(records: list[dict], label: str) -> list[LinePanel]:
    """The panels of ``training_curves.png`` of one run's log: reward, entropy, the gradient norm and the silenced
    fraction of the run's silencing rule; the line is labelled ``label``, which names the run (``stapo-trl train``
    passes the method and seed, for example ``stapo, seed 0``): there is no generic default such as "run"."""
    panels = []
    records = training_records(records)
    spec = silencing_rule(records)
    silenced = (
        (spec.metric("silenced_fraction"), f"{spec.display_name} silenced fraction (%)", 0.0, 100.0)
        if spec is not None
        else ("silenced_fraction", "silenced fraction (%)", 0.0, 100.0)
    )
    for key, title, y_floor, scale in (*TRAINING_CURVES, OPTIMIZATION_METRICS[0], silenced):
        found = metric_series(records, key, label, scale)
        panel = LinePanel(title=title, series=[found] if found is not None else [], y_floor=y_floor)
        if found is None:
            panel.notes.append("not logged by this run")
        panels.append(panel)
    return panels


def plot_training_curves(records: list[dict], path: str | Path, *, label: str, title: str | None = None) -> Path:
    """Write a PNG of reward, entropy, gradient norm and silenced fraction against the step, the line labelled
    ``label``. A metric that the run did not log (for example the mask of a GRPO run) leaves its panel with a note."""
    return plot_line_panels(training_curve_panels(records, label), path, panel_size=(3.9, 3.2), title=title, dpi=110)


def plot_optimization(runs: list[RunLogs], path: Path) -> Path:
    """The gradient norm, completion length, clipped share and (when the gradient probe ran) the silenced tokens'
    share of the squared gradient norm over the steps, one line per run."""
    panels = [
        line_panel(
            [RunLogs(run.label, run.directory, training_records(run.history), run.source) for run in runs],
            key,
            title,
            scale=scale,
            y_floor=y_floor,
        )
        for key, title, y_floor, scale in OPTIMIZATION_METRICS
    ]
    return plot_line_panels(panels, path, panel_size=(4.4, 3.4))


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
        "silenced tokens | candidates | median threshold | grad norm, median (max) | clipped tokens | "
        "held-out accuracy (before → after) | dump written / silenced |"
    )
    lines = [header, "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
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
        grad = f"{s['grad_norm_median']:.3g} ({s['grad_norm_max']:.3g})" if "grad_norm_median" in s else "–"
        dump = f"{s['dump_written']} / {s['dump_silenced']}" if "dump_written" in s else "–"
        lines.append(
            f"| {s['label']} | {s['steps']} | {reward} | {entropy} | {silenced} "
            f"| {_cell(s.get('candidates'), '{}')} | {_cell(s.get('threshold_median'), '{:.3f}')} | {grad} "
            f"| {_cell(s.get('clip_ratio_mean'), '{:.2%}')} | {heldout_cell(s.get('heldout', {}))} | {dump} |"
        )
    return "\n".join(lines)


def heldout_cell(heldout: dict[str, dict[str, Any]]) -> str:
    """Held-out accuracy before → after, ± the binomial standard error, or – when not logged."""

    def one(entry):
        error = entry.get("standard_error")
        return f"{entry['accuracy']:.3f}" + (f" ± {error:.3f}" if error is not None else "")

    if not heldout:
        return "–"
    before, after = heldout.get("before"), heldout.get("after")
    return " → ".join(one(entry) for entry in (before, after) if entry is not None)


def paired_heldout(runs: list[RunLogs]) -> list[str]:
    """Markdown lines comparing the runs' held-out results problem by problem (``heldout_results.jsonl`` of
    `stapo-trl train`), for each pair of runs evaluated on the same problems: how many each solved after training, and
    on how many problems they disagree each way. Empty when fewer than two runs have comparable results."""
    from ..names import HELDOUT_RESULTS_FILE

    results = {}
    for run in runs:
        path = run.directory / HELDOUT_RESULTS_FILE
        if path.is_file():
            records = read_json_lines(path)
            if records and all("after_correct" in record for record in records):
                results[run.label] = records
    lines = []
    labels = list(results)
    for index, first in enumerate(labels):
        for second in labels[index + 1 :]:
            a, b = results[first], results[second]
            if [record["solution"] for record in a] != [record["solution"] for record in b]:
                lines.append(f"- {first} and {second} were evaluated on different held-out problems: not compared.")
                continue
            only_a = sum(1 for x, y in zip(a, b, strict=True) if x["after_correct"] and not y["after_correct"])
            only_b = sum(1 for x, y in zip(a, b, strict=True) if y["after_correct"] and not x["after_correct"])
            solved_a, solved_b = (sum(1 for record in records if record["after_correct"]) for records in (a, b))
            lines.append(
                f"- {first} solved {solved_a} and {second} {solved_b} of the same {len(a)} problems after training; "
                f"{only_a} were solved by {first} alone and {only_b} by {second} alone. "
                + paired_verdict(only_a, only_b)
            )
    return lines


def paired_verdict(only_a: int, only_b: int) -> str:
    """Whether a difference of discordant problems is beyond chance: an exact two-sided sign test (McNemar's)."""
    total = only_a + only_b
    if total == 0:
        return "They agree on every problem."
    smaller = min(only_a, only_b)
    tail = sum(math.comb(total, k) for k in range(smaller + 1)) / 2**total
    p_value = min(1.0, 2 * tail)
    reading = "a difference beyond chance" if p_value < 0.05 else "within chance"
    return f"Exact sign test on the {total} problems they disagree on: p = {p_value:.2g}, {reading}."


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
        "optimization": plot_optimization(runs, output_dir / FIGURES["optimization"]),
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
            in_shadow = any(key.startswith(f"{SHADOW_PREFIX}/") for record in run.history for key in record)
            notes.append(
                f"{run.label}: no token rule silenced tokens in the log ("
                + ("none was applied; the rules in shadow are summarized below)." if in_shadow else "none was on).")
            )

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
    "optimization": "Gradient norm, completion length, clipping and the gradient probe",
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
    for run in runs:
        lines.append(f"- **{run.label}**: `{run.directory}` (log: `{run.source.name}`)")
    lines += ["", _summary_table(summaries), ""]
    lines += [f"> {note}\n" for note in notes]
    lines += [
        "## Trends and what the rules did",
        "",
        "A trend is the least-squares slope against the step, ± its standard error; it is called a rise or a fall "
        "only beyond twice that error. The same sentences are in the run's end-of-run summary and model card.",
        "",
    ]
    for summary in summaries:
        lines.append(f"**{summary['label']}**")
        lines.append("")
        lines += [f"- {sentence}" for sentence in trend_sentences(summary)]
        lines += [f"- {line}" for line in summary.get("rule_lines", [])]
        if "probe_grad_sq_share_mean" in summary:
            lines.append(
                f"- gradient probe: the silenced tokens (for a rule in shadow, the tokens it would silence) carried "
                f"{summary['probe_grad_sq_share_mean']:.2%} of the "
                f"squared gradient norm on average over {summary['probe_grad_sq_share_steps']} probed steps"
                + (
                    f", for {summary['probe_token_share_mean']:.2%} of the loss tokens"
                    if "probe_token_share_mean" in summary
                    else ""
                )
            )
        if "completion_length_mean" in summary:
            lines.append(f"- mean completion length: {summary['completion_length_mean']:.1f} tokens over the run")
        lines.append("")
    comparison = paired_heldout(runs)
    if comparison:
        lines += ["## Held-out problems, run against run", "", *comparison, ""]
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
