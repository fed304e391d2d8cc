"""Grading evaluation samples with the project's reward functions: a sample is correct when any configured grader
accepts it (a positive score). The default pair is the strict `boxed` exact match that training rewards, and
`math_verify`, which also accepts equivalent forms such as `\\frac{1}{2}` for `0.5`. Each grader's verdict is kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards import get_reward_func

DEFAULT_GRADERS = {"boxed": ("boxed", "math_verify"), "dapo": ("dapo", "math_verify")}
"""Graders per prompt style: the style's own exact-match rule, then math-verify."""


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
