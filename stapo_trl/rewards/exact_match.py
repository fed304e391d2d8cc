"""Exact-match rewards: DAPO's `Answer:` rule and JustRL's `\\boxed{}` rule, both +1/-1."""

from __future__ import annotations

from collections.abc import Sequence

from .extraction import last_answer_line, last_boxed_content, normalize_final_answer
from .registry import register_reward
from .text import pair_up

DAPO_WINDOW_CHARS = 300  # DAPO grades only a response's final 300 characters (veRL `math_dapo.compute_score`)
BOXED_WINDOW_CHARS = 100  # JustRL's strict-box rule grades only a response's final 100 characters


def _grade(completions, solution, reward_name: str, window: int, extract, log_extra) -> list[float | None]:
    texts, golds = pair_up(completions, solution, reward_name)
    scores, extracted = [], []
    for text, gold in zip(texts, golds, strict=True):
        raw = extract(text[-window:])
        prediction = None if raw is None else normalize_final_answer(raw)
        extracted.append(prediction)
        normalized_gold = None if gold is None else normalize_final_answer(gold)
        scores.append(None if not normalized_gold else 1.0 if prediction == normalized_gold else -1.0)
    if log_extra is not None:
        log_extra(f"{reward_name}/extracted", extracted)
    return scores


@register_reward("dapo", description="DAPO: +1/-1 exact match of the last `Answer:` line (final 300 chars).")
def dapo_reward(
    completions: Sequence, solution: Sequence | None = None, log_extra=None, **kwargs
) -> list[float | None]:
    """+1 when the last `Answer: ...` line in the final 300 characters equals the gold answer after
    `normalize_final_answer` (DAPO, arXiv 2503.14476, §2.4), else -1; None (which TRL skips) without a gold answer."""
    return _grade(completions, solution, "dapo_reward", DAPO_WINDOW_CHARS, last_answer_line, log_extra)


@register_reward("boxed", description="JustRL: +1/-1 exact match of the last \\boxed{} (final 100 chars).")
def boxed_reward(
    completions: Sequence, solution: Sequence | None = None, log_extra=None, **kwargs
) -> list[float | None]:
    """+1 when the last `\\boxed{...}` in the final 100 characters equals the gold answer after
    `normalize_final_answer` (JustRL's strict-box rule), else -1; None (skipped by TRL) for a missing gold answer."""
    return _grade(completions, solution, "boxed_reward", BOXED_WINDOW_CHARS, last_boxed_content, log_extra)
