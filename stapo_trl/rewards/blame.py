"""Blame where it belongs: an exception raised in training by a user's reward function is reported as coming from that
function, at that step (`reward_function_error`); infinite rewards are warned about with the function that returned
them (`InfiniteRewardWarningCallback`)."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from ..core.errors import UserCodeError
from ..core.trl_seams import StepEventCallback
from ..trl_boundary.helpers import TRL_REWARD_COUNT_MESSAGE

logger = logging.getLogger(__name__)


def _code_objects(function: Any) -> set:
    """The code objects of a reward function: a function's own, or a callable object's ``__call__``."""
    call = type(function).__call__ if not hasattr(function, "__code__") and callable(function) else None
    codes = (getattr(candidate, "__code__", None) for candidate in (function, call, getattr(function, "func", None)))
    return {code for code in codes if code is not None}


def reward_function_error(
    error: BaseException, functions: Sequence[Any], names: Sequence[str], step: int
) -> UserCodeError | None:
    """A `UserCodeError` naming the reward function whose code raised ``error`` (a frame of its traceback) or whose
    output TRL refused (TRL's message names it), and the step; None when the error came from elsewhere."""
    codes = {code: name for function, name in zip(functions, names, strict=True) for code in _code_objects(function)}
    name = next(
        (codes[frame.f_code] for frame, _ in traceback.walk_tb(error.__traceback__) if frame.f_code in codes), None
    )
    if name is None and isinstance(error, ValueError) and str(error).startswith(TRL_REWARD_COUNT_MESSAGE):
        name = str(error)[len(TRL_REWARD_COUNT_MESSAGE) :].split("'", 1)[0]
    if name is None:
        return None
    return UserCodeError(
        f"reward function {name!r} raised {type(error).__name__} at optimizer step {step}: {error}",
        source=f"reward function {name!r}",
        step=step,
    )


class InfiniteRewardWarningCallback(StepEventCallback):
    """Warns, naming the function, at every training generation where a reward function returned +inf or -inf (TRL's
    mean reward and advantages become inf and NaN; None, a completion not scored, is not warned about)."""

    def on_generation_scored(self, trainer, batch, rewards) -> None:
        if rewards is None:
            return
        for column, name in enumerate(trainer.reward_func_names):
            infinite = torch.isinf(rewards[:, column])
            if bool(infinite.any()):
                first = int(infinite.nonzero()[0, 0])
                logger.warning(
                    f"Reward function {name!r} returned {int(infinite.sum())} infinite reward(s) of {infinite.numel()} "
                    f"at optimizer step {trainer.state.global_step + 1} (the first at completion {first}: "
                    f"{float(rewards[first, column])}). TRL's mean reward and advantages become inf and NaN. Return "
                    "finite scores, or None for a completion the function does not score."
                )
