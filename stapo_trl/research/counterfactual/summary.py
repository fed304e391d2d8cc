"""Reading the records of `stapo-trl counterfactual`: paired differences between arms, one per saved generation where
the first arm silenced a token up to the point read (elsewhere the difference is 0 by construction), with 95%
t-intervals over generations and over seeds, a Markdown table and the data of its figure."""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from .arms import ARMS, COMPARISONS, FIRST_PLAN_PRIMARY_COMPARISON, NONE_ARM, PRIMARY_COMPARISON, REFERENCE_ARM

MEASURES = {  # each measure of `stapo_trl.research.counterfactual.study.measure`, with a short title
    "entropy_change": "entropy change (nats/token)",
    "kl_from_state": "KL(updated || state) (nats/token)",
    "reference_log_prob_change": "log p of correct response (nats)",
    "update_norm": "update norm",
}
POINTS = ("first_step", "generation")  # each arm's policy is read after the generation's first and last step
PRIMARY_POINT, PRIMARY_MEASURE = "generation", "entropy_change"  # both plans' primary outcome


@functools.cache
def student_t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """The ``probability`` quantile of Student's t distribution, by bisection on its CDF (the density integrated with
    Simpson's rule): within 1e-6 of the tables."""
    if not 0.5 <= probability < 1 or degrees_of_freedom < 1:
        raise ValueError("needs 0.5 <= probability < 1 and at least 1 degree of freedom")
    v = degrees_of_freedom
    log_norm = math.lgamma((v + 1) / 2) - math.lgamma(v / 2) - 0.5 * math.log(v * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (v + 1) / 2 * math.log1p(x * x / v))

    def cdf(t: float, intervals: int = 1000) -> float:
        width = t / intervals
        total = density(0.0) + density(t)
        total += sum((4 if i % 2 else 2) * density(i * width) for i in range(1, intervals))
        return 0.5 + total * width / 3

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        high *= 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


@dataclass
class Interval:
    n: int
    mean: float | None
    low: float | None
    high: float | None
    values: list[float]

    def reads(self) -> str:
        if self.n < 2:
            return "too few generations"
        return "above 0" if self.low > 0 else "below 0" if self.high < 0 else "includes 0"


def mean_interval(values: list[float]) -> Interval:
    """The mean of ``values`` and its two-sided 95% t-interval (None where fewer than 2 values)."""
    if len(values) < 2:
        return Interval(len(values), values[0] if values else None, None, None, list(values))
    mean = statistics.fmean(values)
    half = student_t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(len(values), mean, mean - half, mean + half, list(values))


def _silenced_up_to(record: dict, point: str) -> int:
    counts = record.get("silenced_per_step") or []
    return counts[0] if point == "first_step" and counts else sum(counts)


def _states_where_silenced(records: list[dict], arm: str, point: str):
    """Each saved state's records, by arm, for the (run, generation)s where ``arm`` silenced a token up to ``point``."""
    by_state: dict[tuple, dict[str, dict]] = {}
    for record in records:
        by_state.setdefault((record.get("run"), record["generation"]), {})[record["arm"]] = record
    return [arms for arms in by_state.values() if arm in arms and _silenced_up_to(arms[arm], point) > 0]


def _value(record: dict, point: str, measure: str) -> float | None:
    return (record.get("points") or {}).get(point, {}).get(measure)


def paired_differences_by_run(
    records: list[dict], first: str, second: str, point: str, measure: str, per_silenced_token=False, selected_by=None
) -> dict[str, list[float]]:
    """``first`` minus ``second`` per (run, generation) where ``selected_by`` (by default ``first``) silenced a token up
    to ``point`` (a count-matched arm silences fewer than the arm it matches where its pool is smaller), divided by
    ``first``'s count with ``per_silenced_token``, grouped by run in the order runs first appear."""
    differences: dict[str, list[float]] = {}
    for arms in _states_where_silenced(records, selected_by or first, point):
        values = [_value(arms[arm], point, measure) for arm in (first, second) if arm in arms]
        if len(values) == 2 and None not in values:
            difference = values[0] - values[1]
            if per_silenced_token:
                difference /= _silenced_up_to(arms[first], point)
            differences.setdefault(arms[first].get("run"), []).append(difference)
    return differences


def paired_differences(records: list[dict], first: str, second: str, point: str, measure: str) -> list[float]:
    """Every run's `paired_differences_by_run`, one list."""
    by_run = paired_differences_by_run(records, first, second, point, measure)
    return [value for values in by_run.values() for value in values]


def comparison_cell(records: list[dict], first: str, second: str, point: str, measure: str, **options) -> dict:
    """The mean `paired_differences_by_run` (with its ``options``) and two 95% t-intervals: over generations, and at
    the seed level (each run's mean one draw), which does not assume successive generations of a run independent."""
    by_run = paired_differences_by_run(records, first, second, point, measure, **options)
    cell = mean_interval([value for values in by_run.values() for value in values]).__dict__
    seed_level = mean_interval([statistics.fmean(values) for values in by_run.values()]).__dict__
    return cell | {"seed_level": seed_level | {"runs": list(by_run)}}


def arm_values(records: list[dict], arm: str, selecting_arm: str, point: str, measure: str) -> list[float]:
    """``arm``'s own value of ``measure`` at ``point``, per (run, generation) where ``selecting_arm`` silenced a token
    up to ``point``: for ``none``, the size of the change that the paired differences are read against."""
    states = _states_where_silenced(records, selecting_arm, point)
    values = [_value(arms[arm], point, measure) for arms in states if arm in arms]
    return [value for value in values if value is not None]


def grad_norm_ratios(records: list[dict], arm: str) -> dict:
    """``arm``'s gradient norm (before clipping) over ``none``'s in the same step, over the steps in which ``arm``
    silenced a token: their number, geometric mean, median, smallest and largest."""
    ratios = []
    for arms in _states_where_silenced(records, arm, "generation"):
        if NONE_ARM not in arms:
            continue
        own, reference = arms[arm].get("grad_norms") or [], arms[NONE_ARM].get("grad_norms") or []
        counts = arms[arm].get("silenced_per_step") or []
        for count, value, base in zip(counts, own, reference, strict=False):
            if count and value is not None and base and math.isfinite(value) and math.isfinite(base):
                ratios.append(value / base)
    if not ratios:
        return {"steps": 0, "geometric_mean": None, "median": None, "min": None, "max": None}
    return {
        "steps": len(ratios),
        "geometric_mean": math.exp(statistics.fmean(math.log(r) for r in ratios)),
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def silenced_profile(records: list[dict], arm: str) -> dict:
    """Over the steps in which ``arm`` silenced a token: the median of their median p and of their median H (nats),
    and how many steps."""
    own = [record.get("silenced_profile") or [] for record in records if record["arm"] == arm]
    profiles = [profile for steps in own for profile in steps if profile.get("log_prob_median") is not None]
    if not profiles:
        return {"steps": 0, "median_p": None, "median_entropy": None}
    return {
        "steps": len(profiles),
        "median_p": statistics.median(math.exp(profile["log_prob_median"]) for profile in profiles),
        "median_entropy": statistics.median(profile["entropy_median"] for profile in profiles),
    }


def summarize(records: list[dict]) -> dict:
    """Counts, the reproduction check and every comparison's interval, by point and measure."""
    nones = [record for record in records if record["arm"] == NONE_ARM]
    counts = [record.get("silenced_per_step") or [] for record in records if record["arm"] == REFERENCE_ARM]
    reproduction = [value for record in nones for value in record.get("reproduction_max_abs_difference") or []]
    comparisons = {
        f"{first} - {second}": {
            point: {measure: comparison_cell(records, first, second, point, measure) for measure in MEASURES}
            for point in POINTS
        }
        for first, second in COMPARISONS
    }
    arms = [arm for arm in ARMS if arm != NONE_ARM]
    primary = {"comparison": " - ".join(PRIMARY_COMPARISON), "point": PRIMARY_POINT, "measure": PRIMARY_MEASURE}
    first_plan = primary | {"comparison": " - ".join(FIRST_PLAN_PRIMARY_COMPARISON)}
    return {
        "generations": len(nones),
        "reference_arm": REFERENCE_ARM,
        "generations_with_silenced_tokens": sum(1 for steps in counts if sum(steps) > 0),
        "generations_with_silenced_tokens_in_first_step": sum(1 for steps in counts if steps and steps[0] > 0),
        "silenced_tokens": sum(sum(steps) for steps in counts),
        "reproduction_max_abs_difference": max(reproduction) if reproduction else None,
        "primary": primary | comparisons[primary["comparison"]][PRIMARY_POINT][PRIMARY_MEASURE],
        "first_plan_primary": first_plan | comparisons[first_plan["comparison"]][PRIMARY_POINT][PRIMARY_MEASURE],
        "comparisons": comparisons,
        "none_over_the_same_generations": {
            point: {
                measure: mean_interval(arm_values(records, NONE_ARM, REFERENCE_ARM, point, measure)).__dict__
                for measure in MEASURES
            }
            for point in POINTS
        },
        "entropy_change_per_silenced_token_vs_none": {
            arm: comparison_cell(records, arm, NONE_ARM, "generation", "entropy_change", per_silenced_token=True)
            for arm in arms
        },
        "grad_norm_ratio_vs_none": {arm: grad_norm_ratios(records, arm) for arm in arms},
        "silenced_token_profile": {arm: silenced_profile(records, arm) for arm in arms},
    }


def _cell(cell: dict) -> str:
    if cell["n"] == 0:
        return "no generation"
    mean, low, high = ("n/a" if cell[key] is None else f"{cell[key]:+.3g}" for key in ("mean", "low", "high"))
    return f"{mean} [{low}, {high}] ({cell['n']})"


def summary_table(summary: dict, point: str = "generation") -> str:
    """A Markdown table: one row per comparison and level (per generation, per seed), one column per measure, each
    cell ``mean [low, high] (n)``; a last row gives the ``none`` arm's own values over the generations where S2T
    silenced a token."""
    header = "| comparison | level | " + " | ".join(MEASURES) + " |"
    lines = [header, "|" + "---|" * (len(MEASURES) + 2)]
    for comparison, points in summary["comparisons"].items():
        cells = points[point]
        lines.append(f"| {comparison} | generation | " + " | ".join(_cell(cells[m]) for m in MEASURES) + " |")
        lines.append("| | seed | " + " | ".join(_cell(cells[m]["seed_level"]) for m in MEASURES) + " |")
    own = summary["none_over_the_same_generations"][point]
    lines.append(
        f"| {NONE_ARM} itself (not a difference) | generation | " + " | ".join(_cell(own[m]) for m in MEASURES) + " |"
    )
    return "\n".join(lines)
