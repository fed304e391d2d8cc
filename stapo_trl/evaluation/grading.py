"""Grading evaluation samples with the project's reward functions.

A sample counts as correct when any configured grader accepts it (a positive score). The default pair is the
strict `boxed` exact match, which is what the training reward sees, and `math_verify`, which also accepts
equivalent forms such as `\\frac{1}{2}` for `0.5`. Each grader's own verdict is kept, so reports can show how many
samples each one accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards import get_reward_func

DEFAULT_GRADERS = {"boxed": ("boxed", "math_verify"), "dapo": ("dapo", "math_verify")}
"""Graders per prompt style: the style's own exact-match rule, then math-verify."""


@dataclass(frozen=True)
class Grade:
    """One sample's grades: each grader's score and extracted answer, and whether any grader accepted it."""

    scores: dict[str, float | None]
    extracted: dict[str, Any]
    correct: bool


class Grader:
    """Grades completions with named rewards from `stapo_trl.rewards` (for example `boxed`, `dapo`,
    `math_verify`)."""

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
        scores: dict[str, list[float | None]] = {}
        extracted: dict[str, list[Any]] = {}
        for name, reward in self._rewards.items():
            logged: list[list[Any]] = []
            scores[name] = list(
                reward(
                    completions=list(completions),
                    solution=list(answers),
                    log_extra=lambda _key, values, logged=logged: logged.append(list(values)),
                )
            )
            extracted[name] = logged[0] if logged else [None] * len(completions)
        grades = []
        for index in range(len(completions)):
            sample_scores = {name: scores[name][index] for name in self.names}
            correct = any(score is not None and score > 0 for score in sample_scores.values())
            grades.append(Grade(sample_scores, {name: extracted[name][index] for name in self.names}, correct))
        return grades
