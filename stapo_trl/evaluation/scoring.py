"""Grading samples with the project's rewards (a sample is correct when any grader accepts it; each grader's verdict is
kept), and avg@k and pass@k from graded samples. avg@k is the paper's metric (STAPO Table 2): the mean correctness of
the k samples of each problem, averaged over problems, an estimate of one sample's accuracy that does not grow with k."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..rewards import get_reward_func

DEFAULT_GRADERS = {"boxed": ("boxed", "math_verify"), "dapo": ("dapo", "math_verify")}  # per prompt style


def accepts(score: float | None) -> bool:
    """Whether a reward's score grades the sample correct: `boxed` and `dapo` score +1/-1, `math_verify` 1/0."""
    return score is not None and score > 0


def reward_verdicts(
    reward: Callable, completions: Sequence[str], solutions: Sequence[str]
) -> tuple[list, list | None]:
    """`reward`'s scores of `completions`, and the answers it reports through TRL's `log_extra` (or None)."""
    logged: list[list[Any]] = []
    scores = reward(
        completions=list(completions),
        solution=list(solutions),
        log_extra=lambda _key, values: logged.append(list(values)),
    )
    return list(scores), (logged[0] if logged else None)


@dataclass(frozen=True)
class Grade:
    """One sample's grades: each grader's score and extracted answer, and whether any grader accepted it."""

    scores: dict[str, float | None]
    extracted: dict[str, Any]
    correct: bool


class Grader:
    """Grades completions with named rewards of `stapo_trl.rewards` (for example `boxed`, `dapo`, `math_verify`)."""

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ValueError("At least one grader is needed, for example ['boxed', 'math_verify'].")
        self.names = tuple(names)
        self._rewards = {name: get_reward_func(name) for name in self.names}

    def grade(self, completions: Sequence[str], answers: Sequence[str]) -> list[Grade]:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} gold answers.")
        if not completions:
            return []
        scores, extracted = {}, {}
        for name, reward in self._rewards.items():
            scores[name], extracted[name] = reward_verdicts(reward, completions, answers)
            extracted[name] = extracted[name] or [None] * len(completions)
        return [
            Grade(
                {name: scores[name][index] for name in self.names},
                {name: extracted[name][index] for name in self.names},
                any(accepts(scores[name][index]) for name in self.names),
            )
            for index in range(len(completions))
        ]


def avg_at_k(correct_by_problem: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of each problem's share of correct samples, in [0, 1]; every problem weighs the same."""
    if not correct_by_problem:
        raise ValueError("avg@k needs at least one problem.")
    if any(len(samples) == 0 for samples in correct_by_problem):
        raise ValueError("avg@k needs at least one sample per problem.")
    return sum(sum(samples) / len(samples) for samples in correct_by_problem) / len(correct_by_problem)


def avg_at_k_standard_error(correct_by_problem: Sequence[Sequence[bool]]) -> float:
    """Standard error of `avg_at_k` over problems: the per-problem accuracies' sample std / sqrt(n); 0 for one."""
    means = [sum(samples) / len(samples) for samples in correct_by_problem]
    if len(means) < 2:
        return 0.0
    mean = sum(means) / len(means)
    variance = sum((value - mean) ** 2 for value in means) / (len(means) - 1)
    return math.sqrt(variance / len(means))


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from `num_samples` samples of which `num_correct` are correct
    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code", Eq. 1): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, num_samples], got {num_correct} of {num_samples}.")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, num_samples={num_samples}], got {k}.")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


@dataclass
class BenchmarkScore:
    """What one benchmark scored under one sampling setting; percentages are in [0, 100]. `grader_correct` counts the
    samples each grader accepted, `correct` those any grader accepted (which count for avg@k), `grader_answered` those
    from which each grader extracted an answer, and `truncated` those stopped by the token limit."""

    benchmark: str
    problems: int
    samples: int
    samples_per_problem: int
    avg_at_k: float
    standard_error: float
    pass_at_k: float
    correct: int
    grader_correct: dict[str, int]
    grader_answered: dict[str, int]
    truncated: int
    mean_completion_tokens: float
    expected_samples: int | None = None
    partial: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.expected_samples is None or self.samples >= self.expected_samples

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete}


def score_benchmark(
    benchmark: str,
    records: Iterable[Mapping[str, Any]],
    *,
    graders: Sequence[str],
    expected_samples: int | None = None,
) -> BenchmarkScore:
    """Aggregate graded sample records (`problem_id`, `correct`, `grades`, `extracted`, `finish_reason`,
    `num_tokens`) of one benchmark into avg@k, pass@k (k: the fewest samples any problem has) and per-grader counts."""
    by_problem: dict[str, list[bool]] = {}
    grader_correct = dict.fromkeys(graders, 0)
    grader_answered = dict.fromkeys(graders, 0)
    truncated = tokens = 0
    records = list(records)
    for record in records:
        by_problem.setdefault(str(record["problem_id"]), []).append(bool(record["correct"]))
        for grader in graders:
            grader_correct[grader] += accepts(record["grades"].get(grader))
            grader_answered[grader] += record.get("extracted", {}).get(grader) is not None
        truncated += record.get("finish_reason") == "length"
        tokens += int(record.get("num_tokens") or 0)
    if not by_problem:
        raise ValueError(f"{benchmark}: there are no graded samples to score.")
    correct_by_problem = list(by_problem.values())
    k = min(len(samples) for samples in correct_by_problem)
    return BenchmarkScore(
        benchmark=benchmark,
        problems=len(correct_by_problem),
        samples=len(records),
        samples_per_problem=k,
        avg_at_k=100.0 * avg_at_k(correct_by_problem),
        standard_error=100.0 * avg_at_k_standard_error(correct_by_problem),
        pass_at_k=100.0 * sum(pass_at_k(len(s), sum(s), k) for s in correct_by_problem) / len(correct_by_problem),
        correct=sum(sum(samples) for samples in correct_by_problem),
        grader_correct=grader_correct,
        grader_answered=grader_answered,
        truncated=truncated,
        mean_completion_tokens=tokens / len(records),
        expected_samples=expected_samples,
    )
