"""The STAPO paper's Table 2 (v1-v3): avg@32 on AIME24/25 and AMC23, avg@4 on the rest, for Qwen3 Base models
trained on DAPO-Math-17K in veRL, in percent as printed, which results tables print under ours."""

from __future__ import annotations

from dataclasses import dataclass

from ..methods import METHOD_TITLES, method_preset

PAPER_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
PAPER_SOURCE = "STAPO paper, Table 2 (arXiv 2602.15620)"
FULL_SIZES = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675}
"""Problems in each benchmark as the paper evaluates it; a run on fewer is marked as partial in tables."""

# (size, method, setting) -> the six benchmarks in PAPER_BENCHMARKS order, then the average.
_TABLE_2: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("1.7B", "grpo", "training-aligned"): (6.88, 4.06, 40.47, 68.60, 32.44, 30.64, 30.52),
    ("1.7B", "grpo", "justrl"): (10.83, 4.06, 41.17, 67.15, 32.53, 30.64, 31.06),
    ("1.7B", "20-entropy", "training-aligned"): (13.33, 8.44, 46.56, 69.85, 28.03, 35.65, 33.64),
    ("1.7B", "20-entropy", "justrl"): (13.85, 7.60, 44.53, 69.10, 29.04, 34.35, 33.08),
    ("1.7B", "justrl", "training-aligned"): (8.85, 6.25, 45.39, 62.70, 22.61, 29.15, 29.16),
    ("1.7B", "justrl", "justrl"): (14.58, 10.93, 51.09, 69.75, 28.89, 34.16, 34.90),
    ("1.7B", "stapo", "training-aligned"): (17.40, 15.42, 55.94, 73.55, 28.22, 38.54, 38.18),
    ("1.7B", "stapo", "justrl"): (16.04, 14.27, 52.42, 70.30, 29.42, 37.87, 36.72),
    ("8B", "grpo", "training-aligned"): (31.25, 24.69, 75.23, 88.90, 55.88, 61.50, 56.24),
    ("8B", "grpo", "justrl"): (32.40, 24.17, 74.14, 88.85, 53.58, 58.34, 55.25),
    ("8B", "stapo", "training-aligned"): (33.44, 28.65, 79.92, 90.40, 57.17, 62.98, 58.76),
    ("8B", "stapo", "justrl"): (39.48, 29.37, 80.23, 91.40, 55.70, 63.32, 59.92),
    ("14B", "grpo", "training-aligned"): (42.19, 30.31, 81.95, 90.05, 55.15, 64.76, 60.74),
    ("14B", "grpo", "justrl"): (40.52, 32.40, 78.12, 92.00, 57.54, 64.28, 60.81),
    ("14B", "stapo", "training-aligned"): (46.98, 35.21, 87.11, 92.45, 59.47, 68.21, 64.38),
    ("14B", "stapo", "justrl"): (54.27, 41.67, 90.62, 93.85, 59.93, 71.62, 68.66),
}


@dataclass(frozen=True)
class PaperRow:
    size: str
    method: str
    setting: str
    scores: dict[str, float]
    average: float

    @property
    def label(self) -> str:
        return f"paper: Qwen3-{self.size}-Base {METHOD_TITLES.get(self.method, self.method)}"


def paper_row(size: str | None, method: str | None, setting: str) -> PaperRow | None:
    """The paper's row for a model size ("1.7B", "8B", "14B"), a method and a setting, or None if the paper has none."""
    if not size or not method:
        return None
    try:
        method = method_preset(method).name
    except ValueError:
        return None
    if (values := _TABLE_2.get((size.upper(), method, setting))) is None:
        return None
    return PaperRow(size.upper(), method, setting, dict(zip(PAPER_BENCHMARKS, values[:-1], strict=True)), values[-1])
