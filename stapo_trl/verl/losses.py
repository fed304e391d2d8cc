"""S2T and STARE as verl policy losses over verl's ``vanilla`` PPO loss (docs/verl.md): ``stapo`` (the S2T mask pooled
over the micro-batch of every data-parallel rank) and ``stare``/``stare_c2`` (STARE's O1 and C2 weights within each
micro-batch, gate always on); :func:`register_s2t_loss` and :func:`register_stare_loss` register other settings."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss
from verl.workers.utils import losses as verl_losses

from ..core.distributed import world_size
from ..core.token_rules import get_token_rule, stare_token_weights
from ..core.token_rules.s2t import check_s2t_thresholds

BASE_LOSS_MODE = "vanilla"
ACTOR_PREFIX = "actor/"
SEQUENCE_MEAN_MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

SILENCING_LOSS_MODES: set[str] = set()
"""The ``loss_mode`` names registered by :func:`register_s2t_loss` (losses that silence tokens per micro-batch)."""


def entropy_from_ppo_loss(expected_shape: torch.Size) -> torch.Tensor:
    """The padded per-token entropy ``[B, T]`` held in the running ``ppo_loss``'s local ``entropy``, which it does not
    pass to the policy loss (docs/verl-internals.md); a ValueError that says what to change when the caller is not
    ``ppo_loss``, verl computed no entropy, or its shape is not ``log_prob``'s."""
    code, frame = verl_losses.ppo_loss.__code__, sys._getframe()
    for _ in range(8):  # ppo_loss calls the policy loss, which calls this function
        if frame is None or (frame.f_code.co_name, frame.f_code.co_filename) == (code.co_name, code.co_filename):
            break
        frame = frame.f_back
    else:
        frame = None
    if frame is None:
        raise ValueError(
            "This policy loss reads the per-token entropy from verl's ppo_loss (verl.workers.utils.losses), and it "
            "was called from somewhere else. Select it with actor_rollout_ref.actor.policy_loss.loss_mode, or call "
            "stapo_trl.verl.losses.s2t_policy_loss with entropy= yourself."
        )
    entropy = frame.f_locals.get("entropy")
    if entropy is None:
        raise ValueError(
            "verl computed no per-token entropy for this micro-batch, and the S2T mask needs it: set "
            "actor_rollout_ref.actor.calculate_entropy=True (entropy_coeff stays 0, so the loss is unchanged)."
        )
    if entropy.shape != expected_shape:
        raise ValueError(
            f"verl's entropy has shape {tuple(entropy.shape)} and log_prob {tuple(expected_shape)}; they must match. "
            "The installed verl no longer pads its entropy as 0.9.1 does: run python -m stapo_trl.verl.drift."
        )
    return entropy


def check_pool_is_data_parallel(config: Any) -> None:
    """Refuse a process group wider than data parallelism, since the S2T pool gathers over every process."""
    batch_info = getattr(config, "global_batch_info", None) or {}
    dp_size = int(batch_info.get("dp_size") or 1)
    if world_size() != dp_size:
        raise ValueError(
            f"The S2T loss pools its candidates over all {world_size()} processes, but verl's data-parallel size is "
            f"{dp_size}: with tensor, pipeline, context or Ulysses sequence parallelism, processes hold copies or "
            "shards of the same sequences, and the pool would count them twice. Run it with data parallelism only "
            "(FSDP without Ulysses), or use loss_mode=stare, which pools within each process."
        )


@contextmanager
def batch_info_over_kept_tokens(
    config: Any, response_mask: torch.Tensor, loss_agg_mode: str, num_silenced: int
) -> Iterator[None]:
    """While the base loss runs, make ``config.global_batch_info`` count the kept tokens (restored on exit): for
    ``token-mean``, ``batch_num_tokens`` less ``num_silenced`` (over all ranks); for the sequence-mean modes, where
    verl leaves ``global_batch_size`` unset (one process), the sequences with a loss token before masking, so that a
    sequence silenced whole still counts, as in verl's trainer and TRL's ``grpo``."""
    batch_info = getattr(config, "global_batch_info", None)
    if batch_info is None:
        yield
        return
    saved = dict(batch_info)
    try:
        if loss_agg_mode == "token-mean" and batch_info.get("batch_num_tokens") is not None:
            batch_info["batch_num_tokens"] = batch_info["batch_num_tokens"] - num_silenced
        if loss_agg_mode in SEQUENCE_MEAN_MODES and batch_info.get("global_batch_size") is None:
            batch_info["global_batch_size"] = int(response_mask.bool().any(dim=-1).sum())
        yield
    finally:
        batch_info.clear()
        batch_info.update(saved)


def s2t_metrics(stats: dict[str, float | int]) -> dict[str, float]:
    """The S2T rule's statistics (named as stapo-trl logs ``s2t/<name>`` with TRL) as verl actor metrics under
    ``actor/s2t/``; undefined values (``tau_h`` of an empty pool) are left out."""
    metrics = {f"{ACTOR_PREFIX}s2t/{name}": float(value) for name, value in stats.items()}
    return {name: value for name, value in metrics.items() if math.isfinite(value)}


def s2t_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
    prob_threshold: float = 0.002,
    entropy_quantile: float = 0.8,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``vanilla`` loss over the tokens the S2T mask keeps, renormalized per ``loss_agg_mode``. ``entropy``
    (``[B, T]``, nats) defaults to the one verl's ``ppo_loss`` computed for this micro-batch. Under
    ``torch.distributed`` every rank must call it together, as verl's engine does."""
    if entropy is None:
        entropy = entropy_from_ppo_loss(log_prob.shape)
    check_pool_is_data_parallel(config)
    loss_mask = response_mask.bool()
    rule = s2t_keep_rule(prob_threshold=prob_threshold, entropy_quantile=entropy_quantile)
    s2t = rule(log_prob.detach(), entropy.detach(), advantages, loss_mask)
    kept = loss_mask & s2t.keep
    with batch_info_over_kept_tokens(config, loss_mask, loss_agg_mode, s2t.stats["num_silenced"]):
        loss, metrics = get_policy_loss_fn(BASE_LOSS_MODE)(
            old_log_prob, log_prob, advantages, kept, loss_agg_mode, config, rollout_is_weights
        )
    return loss, {**metrics, **s2t_metrics(s2t.stats)}


def stare_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    variant: str = "O1",
    top_surprisal_share: float = 0.1,
    positive_weight: float = 1.1,
    negative_weight: float = 0.9,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``vanilla`` loss with STARE's weights on the advantages, selected within this micro-batch of this rank
    (no collective call), with verl's aggregation. Logs the STARE rule's metrics that the weights report, under
    ``actor/stare/``."""
    stare = stare_token_weights(
        log_prob.detach(),
        advantages,
        response_mask.bool(),
        variant=variant,
        top_surprisal_share=top_surprisal_share,
        positive_weight=positive_weight,
        negative_weight=negative_weight,
        gate_on=True,
        across_processes=False,
    )
    weighted = advantages * stare.weights.to(advantages.dtype)
    loss, metrics = get_policy_loss_fn(BASE_LOSS_MODE)(
        old_log_prob, log_prob, weighted, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    for metric in get_token_rule("stare").metrics:
        if metric.statistic in stare.stats:
            metrics[f"{ACTOR_PREFIX}stare/{metric.statistic}"] = float(stare.stats[metric.statistic])
    return loss, metrics


def s2t_keep_rule(*, prob_threshold: float = 0.002, entropy_quantile: float = 0.8):
    """The S2T rule with these thresholds, checked: ``rule(log_probs, entropies, advantages, loss_mask)``."""
    check_s2t_thresholds(prob_threshold, entropy_quantile)
    return functools.partial(get_token_rule("s2t"), prob_threshold=prob_threshold, entropy_quantile=entropy_quantile)


def register_s2t_loss(name: str, *, prob_threshold: float = 0.002, entropy_quantile: float = 0.8):
    """Register :func:`s2t_policy_loss` with these thresholds as verl's ``loss_mode`` ``name``."""
    check_s2t_thresholds(prob_threshold, entropy_quantile)
    loss = functools.partial(s2t_policy_loss, prob_threshold=prob_threshold, entropy_quantile=entropy_quantile)
    SILENCING_LOSS_MODES.add(name)
    return register_policy_loss(name)(loss)


def register_stare_loss(
    name: str,
    *,
    variant: str = "O1",
    top_surprisal_share: float = 0.1,
    positive_weight: float = 1.1,
    negative_weight: float = 0.9,
):
    """Register :func:`stare_policy_loss` with these settings as verl's ``loss_mode`` ``name``."""
    if not 0.0 < top_surprisal_share <= 1.0 or positive_weight <= 0 or negative_weight <= 0:
        raise ValueError(
            f"top_surprisal_share must be in (0, 1] and the weights positive, got {top_surprisal_share}, "
            f"{positive_weight} and {negative_weight}."
        )
    loss = functools.partial(
        stare_policy_loss,
        variant=variant,
        top_surprisal_share=top_surprisal_share,
        positive_weight=positive_weight,
        negative_weight=negative_weight,
    )
    return register_policy_loss(name)(loss)


register_s2t_loss("stapo")
register_stare_loss("stare")
register_stare_loss("stare_c2", variant="C2")
