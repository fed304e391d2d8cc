"""Verifiable math rewards for TRL, registered by name (`get_reward_func("boxed")`, or a dotted path):
`available_rewards()` describes each, docs/data.md compares them and shows their use."""

from __future__ import annotations

from typing import Any

from .exact_match import BOXED_WINDOW_CHARS, DAPO_WINDOW_CHARS, boxed_reward, dapo_reward
from .extraction import last_answer_line, last_boxed_content, normalize_final_answer
from .math_verify import MathVerifyError, MathVerifyReward, Verdict, math_verify_reward
from .registry import REWARD_REGISTRY, PlainTextCompletions, available_rewards, get_reward_func, register_reward
from .text import completion_text, gold_text

# TRL's rewards are imported when one is built: importing the rewards loads no TRL.


@register_reward(
    "math_verify", factory=True, description="1/0 symbolic equivalence via math-verify; None if gold unparsable."
)
def _build_math_verify(**options: Any) -> MathVerifyReward:
    return MathVerifyReward(**options) if options else math_verify_reward


@register_reward(
    "think_format", factory=True, description="TRL's think_format_reward: 1 if <think>...</think> wraps the reasoning."
)
def _build_think_format() -> PlainTextCompletions:
    from trl.rewards import think_format_reward

    return PlainTextCompletions(think_format_reward)


@register_reward(
    "soft_overlong_punishment",
    factory=True,
    description="TRL's soft overlong punishment (DAPO Eq. 13); options max_completion_len, soft_punish_cache.",
)
def _build_soft_overlong_punishment(*, max_completion_len: int, soft_punish_cache: int):
    from trl.rewards import get_soft_overlong_punishment

    return get_soft_overlong_punishment(max_completion_len=max_completion_len, soft_punish_cache=soft_punish_cache)


__all__ = [
    "BOXED_WINDOW_CHARS",
    "DAPO_WINDOW_CHARS",
    "REWARD_REGISTRY",
    "MathVerifyError",
    "MathVerifyReward",
    "PlainTextCompletions",
    "Verdict",
    "available_rewards",
    "boxed_reward",
    "completion_text",
    "dapo_reward",
    "get_reward_func",
    "gold_text",
    "last_answer_line",
    "last_boxed_content",
    "math_verify_reward",
    "normalize_final_answer",
    "register_reward",
]
