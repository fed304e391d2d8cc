"""The record of a training run (``run_summary.json``), built once from the log by `build_run_record` and rendered,
never recomputed, by the end-of-run summary, the card and `stapo-trl report` (docs/diagnostics.md, "Trends")."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.names import SHADOW_PREFIX
from ..core.token_rules import TokenRuleSpec, registered_rules
from ..core.token_rules.registry import LAST, MEAN, MEDIAN, STEPS_ABOVE_ZERO, SUM
from ..file_and_metric_names import RUN_SUMMARY_FILE
from ..research.gradient_probe import PROBE_METRIC_PREFIX
from ..storage import read_json_file, write_text_atomically

MIN_STEPS = 4
"""Fewer logged steps than this give no slope: the verdict is "too few steps to tell"."""
SIGNIFICANCE = 2.0
"""A slope is a rise or a fall when it is more than this many standard errors from zero."""
TREND_METRICS = (("reward", "mean reward"), ("entropy", "mean token entropy (nats)"))
OPTIMIZATION_METRICS = ("grad_norm", "completions/mean_length", "clip_ratio/region_mean")
"""TRL's statistics of the updates that the record summarises, beside every ``gradient_probe/*`` statistic."""
HELDOUT_METRICS = {
    "accuracy": "eval_heldout_accuracy",
    "standard_error": "eval_heldout_accuracy_standard_error",
    "correct": "eval_heldout_correct",
    "total": "eval_heldout_total",
    "format_rate": "eval_heldout_format_rate",
}
"""The held-out greedy evaluation as `stapo-trl train` logs it: each field of the result and its metric."""
SILENCED_EXAMPLES = 3
"""Dumped silenced tokens the record shows in context, spread over the run (first, middle, last)."""
SUMMARIES = {
    SUM: lambda values: int(sum(values)),
    MEAN: lambda values: sum(values) / len(values),
    MEDIAN: statistics.median,
    LAST: lambda values: values[-1],
    STEPS_ABOVE_ZERO: lambda values: sum(1 for value in values if value > 0),
}


def is_finite_number(value) -> bool:
    """Whether a logged value is a finite number: not None (TRL logs None for a window of NaN), NaN, inf or a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_training_record(record: dict) -> bool:
    """Whether a logged record is a step's: not the final summary (``train_runtime``) or an evaluation (``eval_*``)."""
    return "train_runtime" not in record and not any(key.startswith("eval_") for key in record)


def training_records(records: list[dict]) -> list[dict]:
    return [record for record in records if is_training_record(record)]


def finite_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` where finite; a record without a ``step`` is the step after the one before."""
    points = [(r.get("step", i + 1), float(r[key])) for i, r in enumerate(records) if is_finite_number(r.get(key))]
    return [step for step, _ in points], [value for _, value in points]


@dataclass(frozen=True)
class Trend:
    """How one metric moved: quarter means, and the least-squares slope per step with its standard error."""

    label: str
    first_quarter: float
    last_quarter: float
    slope: float | None
    slope_standard_error: float | None
    steps: int

    @property
    def verdict(self) -> str:
        if self.slope is None or self.slope_standard_error is None:
            return "too few steps to tell"
        if abs(self.slope) > SIGNIFICANCE * self.slope_standard_error:
            return "rises" if self.slope > 0 else "falls"
        return "no trend beyond its step-to-step scatter"

    def sentence(self) -> str:
        """The one sentence the summary, the card and the report print for this metric."""
        text = (
            f"{self.label} {self.first_quarter:.3f} (first quarter of steps) -> {self.last_quarter:.3f} (last quarter)"
        )
        if self.slope is None:
            return f"{text}; {self.verdict} ({self.steps} steps)"
        return (
            f"{text}; slope {self.slope:+.4f} ± {self.slope_standard_error:.4f} per step over {self.steps} steps: "
            f"{self.verdict}"
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, values: dict) -> Trend:
        return cls(**{item.name: values[item.name] for item in dataclasses.fields(cls)})


def trend(label: str, steps: list[int], values: list[float]) -> Trend | None:
    """The trend of ``values`` logged at ``steps`` (quarters of at least one value); None when nothing was logged."""
    if not values:
        return None
    n, quarter = len(values), max(1, len(values) // 4)
    slope = standard_error = None
    if n >= MIN_STEPS and len(set(steps)) > 1:
        mean_x, mean_y = sum(steps) / n, sum(values) / n
        sxx = sum((x - mean_x) ** 2 for x in steps)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values, strict=True)) / sxx
        residuals = [y - mean_y - slope * (x - mean_x) for x, y in zip(steps, values, strict=True)]
        standard_error = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx)
    return Trend(label, sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter, slope, standard_error, n)


def visible_token(text: str) -> str:
    """A token's text with its whitespace made visible, for axis labels and tables."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"


def token_in_context(record: dict[str, Any], context: int, brackets: tuple[str, str] = ("[", "]")) -> str:
    """``…before[token]after…``: a dumped token (`visible_token`) between ``brackets``, with up to ``context``
    characters of its context either side, line breaks shown as ↵."""
    before = record["context_before"][-context:].replace("\n", "↵")
    after = record["context_after"][:context].replace("\n", "↵")
    return f"…{before}{brackets[0]}{visible_token(record['token'])}{brackets[1]}{after}…"


def silenced_token_line(record: dict[str, Any], context: int = 60, code: bool = True) -> str:
    """A dumped silenced token in its context (backticks shown as '), with p, H and the response's advantage; as
    inline Markdown code when ``code``."""
    text = token_in_context(record, context, ("[[", "]]")).replace("`", "'")
    return f"step {record['step']}, p {record['p']:.2g}, H {record['entropy']:.2f}, A {record['advantage']:+.2f}: " + (
        f"`{text}`" if code else text
    )


def spread(records: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` records spread evenly over the list (first and last included)."""
    if len(records) <= count:
        return list(records)
    return [records[round(index * (len(records) - 1) / (count - 1))] for index in range(count)]


@dataclass
class RunRecord:
    """What one run did, as ``run_summary.json`` holds it. Every field is plain JSON."""

    steps: int = 0
    """The highest step in the log; ``logged_steps`` counts its training records."""
    logged_steps: int = 0
    last_logged_step: int | None = None
    trends: dict[str, dict[str, Any]] = field(default_factory=dict)
    """`Trend.to_dict` of each logged `TREND_METRICS`; ``reward_first``, ``reward_last``: reward's quarter means."""
    reward_first: float | None = None
    reward_last: float | None = None
    token_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    shadow_token_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each rule's run summary (the keys of its `RuleMetric` summaries) by name, applied or run in shadow."""
    optimization: dict[str, dict[str, float]] = field(default_factory=dict)
    """Mean, median, max and number of logged steps of `OPTIMIZATION_METRICS` and ``gradient_probe/*``, by metric."""
    accuracy_before: dict[str, Any] | None = None
    accuracy_after: dict[str, Any] | None = None
    """The held-out greedy accuracy at step 0 and at the last evaluation (the fields of `HELDOUT_METRICS`)."""
    dump: dict[str, int] | None = None
    """The dump's totals ``silenced``, ``written`` and ``dropped``; ``silenced_examples``: a few tokens in context."""
    silenced_examples: list[str] = field(default_factory=list)
    method: str | None = None
    model: str | None = None
    base_model: str | None = None
    """The model that saved adapters and the card name as their base: a Hub id where one is known."""
    model_source: str | None = None
    """``model_name_or_path`` as given (a GGUF file's reference, not its conversion in this machine's cache)."""
    dataset_description: str | None = None
    """What the model was trained on, for the model card, when it is not a Hub dataset."""
    dataset_reference: str | None = None
    """``dataset_name`` as given (a Hub id, ``arithmetic``, ``sample``, or a local path's name), for model-index."""
    seconds_total: float | None = None
    seconds_training: float | None = None
    files: dict[str, str] = field(default_factory=dict)
    """The files the run wrote, relative to ``output_dir``."""
    output_dir: str | None = None

    def silencing_rule(self, shadow: bool = False) -> str | None:
        """The first rule in apply order whose summary (of those in shadow, for ``shadow``) has a silenced fraction."""
        summaries = self.shadow_token_rules if shadow else self.token_rules
        return next(
            (spec.name for spec in registered_rules() if "silenced_fraction" in summaries.get(spec.name, {})), None
        )

    def silencing_summary(self) -> dict[str, Any]:
        """The run summary of the applied `silencing_rule`, or ``{}``."""
        return self.token_rules.get(self.silencing_rule(), {})


def build_run_record(
    log_history: list[dict], *, silenced_tokens: list[dict] | None = None, dump_stats: dict | None = None, **given: Any
) -> RunRecord:
    """The record of a run from its log history (``trainer_state.json``'s, or the records of ``metrics.jsonl``), its
    silenced-token dump when it has one, and ``given``, the fields only the caller knows (``method``, timings, ...)."""
    record = RunRecord(**given)
    steps = training_records(log_history)
    record.steps = max((entry["step"] for entry in log_history if "step" in entry), default=0)
    record.logged_steps = len(steps)
    record.last_logged_step = steps[-1].get("step", len(steps)) if steps else None
    trends = {key: trend(label, *finite_series(steps, key)) for key, label in TREND_METRICS}
    record.trends = {key: found.to_dict() for key, found in trends.items() if found is not None}
    if trends["reward"] is not None:
        record.reward_first, record.reward_last = trends["reward"].first_quarter, trends["reward"].last_quarter
    for spec in registered_rules():
        for summaries, prefix in ((record.token_rules, ""), (record.shadow_token_rules, f"{SHADOW_PREFIX}/")):
            if summary := rule_summary(spec, steps, prefix):
                summaries[spec.name] = summary
    probed = sorted({key for entry in steps for key in entry if key.startswith(f"{PROBE_METRIC_PREFIX}/")})
    for key in (*OPTIMIZATION_METRICS, *probed):
        if values := finite_series(steps, key)[1]:
            record.optimization[key] = {
                "mean": sum(values) / len(values),
                "median": statistics.median(values),
                "max": max(values),
                "steps": len(values),
            }
    logged = [entry for entry in log_history if is_finite_number(entry.get(HELDOUT_METRICS["accuracy"]))]
    results = [{name: entry.get(metric) for name, metric in HELDOUT_METRICS.items()} for entry in logged]
    if logged and logged[0].get("step") == 0:
        record.accuracy_before = results[0]
    if logged and logged[-1].get("step") != 0:
        record.accuracy_after = results[-1]
    if dump_stats is not None:
        record.dump = {key: dump_stats[key] for key in ("silenced", "written", "dropped")}
    if silenced_tokens:
        record.silenced_examples = [
            silenced_token_line(token, context=40, code=False) for token in spread(silenced_tokens, SILENCED_EXAMPLES)
        ]
    return record


def rule_summary(spec: TokenRuleSpec, steps: list[dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """A rule's run summary from its metrics' finite values (``prefix`` reads a rule in shadow); ``{}`` if none."""
    summary = {}
    for metric in spec.metrics:
        if values := finite_series(steps, prefix + spec.metric(metric.statistic))[1]:
            summary.update({key: SUMMARIES[kind](values) for key, kind in metric.summaries})
    return summary


def write_run_record(record: RunRecord, output_dir: str | Path) -> Path:
    """Write ``output_dir/run_summary.json`` atomically."""
    text = json.dumps(dataclasses.asdict(record), indent=2) + "\n"
    return write_text_atomically(Path(output_dir) / RUN_SUMMARY_FILE, text)


def read_run_record(output_dir: str | Path) -> RunRecord | None:
    """The record `stapo-trl train` wrote in ``output_dir``, or None for a run without one."""
    path = Path(output_dir) / RUN_SUMMARY_FILE
    if not path.is_file():
        return None
    values = read_json_file(path, "the run's record", "Delete it to rewrite the card without the run's facts.")
    known = {item.name for item in dataclasses.fields(RunRecord)}
    return RunRecord(**{key: value for key, value in values.items() if key in known})


class _WordingFormatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec == "on/off":
            return "on" if value >= 0.5 else "off"
        if format_spec.endswith("d") and isinstance(value, float):
            value = int(value)
        return super().format_field(value, format_spec)


_FORMATTER = _WordingFormatter()


def fill(template: str, values: dict[str, Any]) -> str | None:
    """A rule's wording (`RulePresentation`) filled from ``values``; None when a field it names is not finite there."""
    names = [name for _, name, _, _ in _FORMATTER.parse(template) if name]
    return _FORMATTER.format(template, **values) if all(is_finite_number(values.get(n)) for n in names) else None


def fill_first(alternatives: str | tuple[str, ...], values: dict[str, Any]) -> str | None:
    """The first of the alternative wordings that fills (a single wording is one alternative)."""
    templates = (alternatives,) if isinstance(alternatives, str) else alternatives
    return next((filled for template in templates if (filled := fill(template, values)) is not None), None)


def rule_summary_line(record: RunRecord, spec: TokenRuleSpec, shadow: bool = False) -> tuple[str, str] | None:
    """``(label, text)`` of a rule's summary in the record (``shadow``: as a rule run in shadow), in its own words
    (`RulePresentation.summary`), or None when the record has none."""
    summary = (record.shadow_token_rules if shadow else record.token_rules).get(spec.name)
    if summary is None or not spec.presentation.summary:
        return None
    text = fill(spec.presentation.summary, {**summary, "steps": record.logged_steps})
    return None if text is None else (spec.presentation.summary_label, text)


def rule_summary_lines(record: RunRecord) -> list[tuple[str, str]]:
    """The summary line of each applied rule, in apply order."""
    return [line for spec in registered_rules() if (line := rule_summary_line(record, spec)) is not None]


def trend_sentences(record: RunRecord) -> list[str]:
    """The record's trends as the sentences the end-of-run summary, the card and the report print alike."""
    return [Trend.from_dict(values).sentence() for values in record.trends.values()]


def step_line_parts(logs: dict[str, Any]) -> list[str]:
    """What each rule shows of one logged step on the console, in apply order."""
    parts = []
    for spec in registered_rules():
        statistics_ = {metric.statistic: logs.get(spec.metric(metric.statistic)) for metric in spec.metrics}
        parts += [part for part in (fill(template, statistics_) for template in spec.presentation.step) if part]
    return parts
