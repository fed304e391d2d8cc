"""One way to say how a logged metric moved over a run, with its uncertainty, for the end-of-run summary of
`stapo-trl train`, the model card and `stapo-trl report` alike, so that the three never disagree: the least-squares
slope with its standard error (`MIN_STEPS`, `SIGNIFICANCE`; docs/diagnostics.md, "Trends, the same everywhere"), and
the first- and last-quarter means beside it as the plain numbers a reader checks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

MIN_STEPS = 4
"""Fewer logged steps than this give no slope: the verdict is "too few steps to tell"."""
SIGNIFICANCE = 2.0
"""A slope is a rise or a fall when it is more than this many standard errors from zero."""


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
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, values: dict) -> Trend:
        return cls(**{item.name: values[item.name] for item in fields(cls)})


def trend(label: str, steps: list[int], values: list[float]) -> Trend | None:
    """The trend of ``values`` logged at ``steps``, with the means of their first and last quarter (at least one
    value each); None when nothing was logged."""
    if not values:
        return None
    n = len(values)
    quarter = max(1, n // 4)
    slope = standard_error = None
    if n >= MIN_STEPS and len(set(steps)) > 1:
        mean_x, mean_y = sum(steps) / n, sum(values) / n
        sxx = sum((x - mean_x) ** 2 for x in steps)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values, strict=True)) / sxx
        residuals = [y - mean_y - slope * (x - mean_x) for x, y in zip(steps, values, strict=True)]
        standard_error = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx)
    return Trend(label, sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter, slope, standard_error, n)


def is_training_record(record: dict) -> bool:
    """Whether a logged record is a training step: not the end-of-training summary (``train_runtime``) and not an
    evaluation record (keys ``eval_*``)."""
    return "train_runtime" not in record and not any(key.startswith("eval_") for key in record)


def training_records(records: list[dict]) -> list[dict]:
    """The records of a log that are training steps: not evaluation records, not the end-of-training summary."""
    return [record for record in records if is_training_record(record)]


def is_finite_number(value) -> bool:
    """Whether a logged value is a finite number: not None (TRL logs None for a window of NaN), not NaN or infinite,
    not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def finite_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the training records, skipping records where it is missing or not finite.
    A record without a ``step`` counts as the step after the one before it."""
    points = []
    for index, record in enumerate(record for record in records if is_training_record(record)):
        value = record.get(key)
        if is_finite_number(value):
            points.append((record.get("step", index + 1), float(value)))
    return [step for step, _ in points], [value for _, value in points]


TREND_METRICS = (("reward", "mean reward"), ("entropy", "mean token entropy (nats)"))
"""The metrics whose trend the summary, the card and the report state, with their labels."""


def run_trends(records: list[dict]) -> dict[str, Trend]:
    """The trends of `TREND_METRICS` over a run's logged training records (those that were logged)."""
    found = {key: trend(label, *finite_series(records, key)) for key, label in TREND_METRICS}
    return {key: result for key, result in found.items() if result is not None}
