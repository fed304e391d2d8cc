"""What the figures of `stapo-trl report` and `stapo-trl train` show of runs, as :mod:`.plotting`'s data classes."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.names import SHADOW_PREFIX
from ..core.token_rules import get_token_rule, registered_rules
from .plotting import (
    DensityPanel,
    LinePanel,
    Series,
    TokenBars,
    plot_density_panels,
    plot_line_panels,
    plot_token_bars,
)
from .run_record import is_finite_number, rule_summary, spread, token_in_context, training_records, visible_token

if TYPE_CHECKING:
    from .report import RunLogs

FIGURE_TITLES = {
    "entropy": "Mean token entropy",
    "reward": "Reward",
    "masking": "Silenced fraction and the silencing threshold",
    "optimization": "Gradient norm, completion length, clipping and the gradient probe",
    "token_density": "Probability and entropy of positive-advantage tokens",
    "top_silenced_tokens": "Top silenced tokens",
}
FIGURES = {name: f"{name}.png" for name in FIGURE_TITLES}

OPTIMIZATION_PANELS = (
    ("grad_norm", "gradient norm before clipping", 0.0, 1.0),
    ("completions/mean_length", "mean completion length (tokens)", 0.0, 1.0),
    ("clip_ratio/region_mean", "share of tokens clipped (%)", 0.0, 100.0),
    ("gradient_probe/silenced_grad_sq_share", "silenced tokens' share of |gradient|^2 (probe)", 0.0, 1.0),
)
"""(metric, title, lowest value the axis shows, scale) of ``optimization.png``."""
TRAINING_CURVES = (("reward", "mean reward", None, 1.0), ("entropy", "mean token entropy (nats)", 0.0, 1.0))
"""The same for the first panels of ``training_curves.png``; the gradient norm and the silenced fraction follow."""


def top_silenced_tokens(run: RunLogs, limit: int = 15) -> list[tuple[str, int]]:
    """The most frequent token texts among the run's dumped silenced tokens (a sample when the caps dropped some)."""
    return Counter(record["token"] for record in run.silenced_tokens or []).most_common(limit)


def metric_series(history: list[dict[str, Any]], key: str, label: str, scale: float = 1.0) -> Series | None:
    """The series of ``key`` in a run's log (None where a value is not finite), or None when no record has it."""
    logged = [record for record in history if key in record]
    if not logged:
        return None
    values = [scale * record[key] if is_finite_number(record[key]) else None for record in logged]
    return Series(label=label, steps=[record["step"] for record in logged], values=values)


def line_panel(
    runs: list[RunLogs], key: str, title: str, *, scale: float = 1.0, y_floor: float | None = None
) -> LinePanel:
    """The panel of ``key`` over the runs; a run without the key gets the note ``"<label>: not logged"``."""
    panel = LinePanel(title=title, series=[], y_floor=y_floor)
    for run in runs:
        if (found := metric_series(run.history, key, run.label, scale)) is None:
            panel.notes.append(f"{run.label}: not logged")
        else:
            panel.series.append(found)
    return panel


def masking_panels(runs: list[RunLogs]) -> tuple[LinePanel, LinePanel]:
    """The silenced fraction (%) of each run's `RunRecord.silencing_rule` (else of the rule in shadow), with its
    silenced tokens and candidates, and the metric it summarises as ``threshold_median`` (S2T's ``tau_h``) per step."""
    absent = "no token rule silenced tokens (none was on)"
    fraction, threshold = (LinePanel(title="", series=[], y_floor=0.0) for _ in range(2))
    rules, thresholds = {}, {}  # ordered sets: the rules and threshold titles, in order of first appearance
    for run in runs:
        record = run.record
        shadow = record.silencing_rule() is None
        if (name := record.silencing_rule(shadow=shadow)) is None:
            fraction.notes.append(f"{run.label}: {absent}")
            threshold.notes.append(f"{run.label}: {absent}")
            continue
        spec, prefix = get_token_rule(name), f"{SHADOW_PREFIX}/" if shadow else ""
        summary = (record.shadow_token_rules if shadow else record.token_rules)[name]
        label = f"{run.label} (in shadow, would silence)" if prefix else run.label
        found = metric_series(run.history, prefix + spec.metric("silenced_fraction"), label, 100.0)
        rules[spec.display_name] = None
        if found.defined and all(value == 0.0 for _, value in found.defined):
            fraction.notes.append(f"{label}: 0% at every step")
        of = f" of {summary['candidates']} candidates" if "candidates" in summary else ""
        found.label = f"{label}: {summary['silenced_tokens']}{of} silenced"
        fraction.series.append(found)
        metric = next((metric for metric in spec.metrics if "threshold_median" in dict(metric.summaries)), None)
        line = metric_series(run.history, prefix + spec.metric(metric.statistic), label) if metric else None
        if line is None:
            threshold.notes.append(f"{label}: {spec.display_name} has no threshold")
            continue
        threshold.series.append(line)
        definition = metric.meaning.split(";")[0]
        threshold.undefined_label = f"no candidates, so no {definition.split(':')[0]}"
        thresholds[f"{definition} ({metric.unit})"] = None
    fraction.title = f"{', '.join(rules) or 'token rule'} silenced fraction of loss tokens (%)"
    threshold.title = "; ".join(thresholds) or "threshold of the silencing rule"
    if threshold.series and not any(series.defined for series in threshold.series):
        threshold.notes.append(f"{threshold.undefined_label} at every logged step")
    return fraction, threshold


def token_bars(run: RunLogs, limit: int = 15) -> TokenBars:
    """One run's bars of its most frequent silenced tokens, or a table of them in context when all counts are equal."""
    written = len(run.silenced_tokens or [])
    if run.dump_stats is None:
        return TokenBars(run.label, [], [], note="no token dump: train with dump_silenced_tokens: true")
    title = f"{run.label}\n{written} dumped of {run.record.dump['silenced']} silenced"
    top = top_silenced_tokens(run, limit)
    distinct = len({record["token"] for record in run.silenced_tokens or []})
    if not top:
        steps = len(run.dump_stats.get("steps", [])) or run.record.steps
        candidates = run.record.silencing_summary().get("candidates")
        detail = f", {candidates} candidates" if candidates is not None else ""
        return TokenBars(title, [], [], note=f"no token was silenced in {steps} steps{detail}")
    if len({count for _, count in top}) == 1:
        records = spread(run.silenced_tokens or [], limit)
        title += f"\n{distinct} distinct tokens, each silenced {top[0][1]} time{'s' if top[0][1] > 1 else ''}"
        if len(records) < written:
            title += f"; {len(records)} shown, spread over the run"
        rows = [
            (str(r["step"]), token_in_context(r, 24), f"{r['p']:.2g}", f"{r['entropy']:.2f}", f"{r['advantage']:+.2f}")
            for r in records
        ]
        return TokenBars(title, [], [], rows=rows)
    if distinct > len(top):
        title += f"\n{len(top)} of {distinct} distinct tokens, most frequent first"
    return TokenBars(title, [visible_token(text) for text, _ in top], [count for _, count in top])


def density_panel(run: RunLogs) -> DensityPanel:
    """One run's p-H density; the silencing region spans the probability bound and the median threshold."""
    if run.dump_stats is None:
        return DensityPanel(run.label, note="no token dump:\ntrain with dump_silenced_tokens: true")
    stats, density = run.dump_stats, run.dump_stats["density"]
    extent = tuple(float(value) for value in (*density["log10_p_range"], *density["entropy_range"]))
    panel = DensityPanel(run.label, counts=density["positive_advantage"], extent=extent)
    if panel.num_tokens == 0:
        panel.note = "no completion token had a positive advantage"
    probability_bound = stats.get("probability_bound")
    threshold = run.record.silencing_summary().get("threshold_median")
    if probability_bound and threshold is not None:
        panel.silenced_box = (math.log10(probability_bound), threshold)
    elif probability_bound:
        panel.threshold_only = math.log10(probability_bound)
    x_low, _, _, y_high = extent
    panel.silenced = [
        (max(x_low, math.log10(max(record["p"], 1e-300))), min(y_high, record["entropy"]))
        for record in run.silenced_tokens or []
    ]
    return panel


def training_curve_panels(records: list[dict], label: str) -> list[LinePanel]:
    """The panels of ``training_curves.png`` of one run's log, its line labelled ``label`` (the method and seed)."""
    panels, records = [], training_records(records)
    spec = next((spec for spec in registered_rules() if "silenced_fraction" in rule_summary(spec, records)), None)
    metric, name = (spec.metric("silenced_fraction"), f"{spec.display_name} ") if spec else ("silenced_fraction", "")
    silenced = (metric, f"{name}silenced fraction (%)", 0.0, 100.0)
    for key, title, y_floor, scale in (*TRAINING_CURVES, OPTIMIZATION_PANELS[0], silenced):
        found = metric_series(records, key, label, scale)
        panel = LinePanel(title=title, series=[found] if found is not None else [], y_floor=y_floor)
        if found is None:
            panel.notes.append("not logged by this run")
        panels.append(panel)
    return panels


def plot_training_curves(records: list[dict], path: str | Path, *, label: str, title: str | None = None) -> Path:
    """Write a PNG of reward, entropy, gradient norm and silenced fraction against the step."""
    return plot_line_panels(training_curve_panels(records, label), path, panel_size=(3.9, 3.2), title=title, dpi=110)


def density_limits(runs: list[RunLogs]) -> tuple[float, float] | None:
    """The lowest log10 p and highest H of the runs' populated bins and probability bounds, with a margin, or None."""
    limits = []
    for stats in [run.dump_stats for run in runs if run.dump_stats is not None]:
        counts = np.add(stats["density"]["positive_advantage"], stats["density"]["other"])
        if counts.sum() == 0:
            continue
        x_low, x_high, y_low, y_high = (*stats["density"]["log10_p_range"], *stats["density"]["entropy_range"])
        rows, columns = np.nonzero(counts)
        x_width, y_width = (x_high - x_low) / counts.shape[0], (y_high - y_low) / counts.shape[1]
        lowest_p = x_low + rows.min() * x_width - 2 * x_width
        if probability_bound := stats.get("probability_bound"):
            lowest_p = min(lowest_p, math.log10(probability_bound) - 2 * x_width)
        highest_h = y_low + (columns.max() + 1) * y_width * 1.15 + y_width
        limits.append((max(x_low, float(lowest_p)), min(y_high, float(highest_h))))
    return (min(low for low, _ in limits), max(high for _, high in limits)) if limits else None


def plot_report_figures(runs: list[RunLogs], output_dir: Path, top_tokens: int) -> dict[str, Path]:
    """Draw the report's `FIGURES` (the token figures when a run has a dump) into ``output_dir``, by name."""
    optimization = [
        line_panel(runs, key, title, scale=scale, y_floor=y_floor)
        for key, title, y_floor, scale in OPTIMIZATION_PANELS
    ]
    line_figures = {
        "entropy": ([line_panel(runs, "entropy", "mean token entropy (nats)", y_floor=0.0)], (6, 3.6)),
        "reward": ([line_panel(runs, "reward", "mean reward")], (6, 3.6)),
        "masking": (masking_panels(runs), (5.5, 3.8)),
        "optimization": (optimization, (4.4, 3.4)),
    }
    figures = {
        name: plot_line_panels(panels, output_dir / FIGURES[name], panel_size=size)
        for name, (panels, size) in line_figures.items()
    }
    if any(run.dump_stats is not None for run in runs):
        densities, limits = [density_panel(run) for run in runs], density_limits(runs)
        figures["token_density"] = plot_density_panels(densities, output_dir / FIGURES["token_density"], limits)
        bars = [token_bars(run, top_tokens) for run in runs]
        figures["top_silenced_tokens"] = plot_token_bars(bars, output_dir / FIGURES["top_silenced_tokens"], top_tokens)
    return figures
