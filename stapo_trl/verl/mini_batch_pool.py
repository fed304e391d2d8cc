"""The tensor part of :mod:`.pool_trainer`: the S2T mask pooled over each whole mini-batch (one optimizer step, every
data-parallel rank) of verl's actor update, from the policy before the update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.distributed import world_size
from ..core.token_rules import TokenRuleResult

POOL_TRAINER_MODES: set[str] = {"stapo_sync"}
"""The pool trainer's mode names, known to the start-up checks where verl's v1 trainer cannot be imported."""


def optimizer_step_rows(batch_size: int, dp_size: int, mini_batch_size: int) -> list[torch.Tensor]:
    """The rows each optimizer step of verl's actor update trains on. ``mini_batch_size`` counts one step's rows over
    all ranks (``ppo_mini_batch_size × rollout.n``). The batch is cut into ``dp_size`` contiguous chunks, one per rank,
    each chunk into contiguous mini-batches; step *j* is the *j*-th mini-batch of every rank, in rank order."""
    if batch_size % dp_size or mini_batch_size % dp_size:
        raise ValueError(
            f"verl splits the batch ({batch_size} rows) and the mini-batch ({mini_batch_size} rows) evenly over "
            f"{dp_size} data-parallel ranks; both must be multiples of it."
        )
    per_rank, per_rank_step = batch_size // dp_size, mini_batch_size // dp_size
    if per_rank % per_rank_step:
        raise ValueError(
            f"Each rank holds {per_rank} rows, which is not a whole number of mini-batches of {per_rank_step} rows."
        )
    return [
        torch.cat([torch.arange(start, start + per_rank_step) + rank * per_rank for rank in range(dp_size)])
        for start in range(0, per_rank, per_rank_step)
    ]


@dataclass
class WholeStepMask:
    """``keep`` ``[B, T]`` bool, False where S2T silences the token; the rule's statistics of each optimizer step."""

    keep: torch.Tensor
    step_stats: list[dict[str, float | int]]


def whole_step_keep(
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    step_rows: list[torch.Tensor],
    keep_rule: Callable[..., TokenRuleResult],
) -> WholeStepMask:
    """The keep-mask of ``keep_rule`` (:func:`~stapo_trl.verl.losses.s2t_keep_rule`) over the padded ``[B, T]``
    tensors of the whole batch, applied to each optimizer step's rows at once (``tau_h`` over the step); rows in no
    step are kept whole. It gathers nothing, so it refuses to run under ``torch.distributed``."""
    if world_size() > 1:
        raise RuntimeError(
            "whole_step_keep pools the rows it is given, which must be every rank's: call it in one process (verl's "
            "driver), not under torch.distributed."
        )
    keep = torch.ones_like(response_mask, dtype=torch.bool)
    step_stats = []
    for rows in step_rows:
        result = keep_rule(log_probs[rows], entropies[rows], advantages[rows], response_mask[rows].bool())
        keep[rows] = result.keep
        step_stats.append(result.stats)
    return WholeStepMask(keep, step_stats)
