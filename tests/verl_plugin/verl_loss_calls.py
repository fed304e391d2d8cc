"""Calls of verl's own ``ppo_loss`` on given float64 tensors, laid out as verl's actor lays them out, for the verl
plugin's tests. Importing this needs verl."""

from __future__ import annotations

import torch
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from stapo_trl.verl.actor_batch import actor_micro_batches, actor_mini_batch, model_output


def actor_config(loss_mode: str, loss_agg_mode: str = "token-mean", micro_batch_size: int = 1) -> ActorConfig:
    """An actor config with the paper's clip range (0.2, 0.28); verl's other defaults."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=micro_batch_size,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


def verl_loss(
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages,
    response_mask: torch.Tensor,
    loss_mode: str,
    loss_agg_mode: str = "token-mean",
    *,
    micro_batch_size: int | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
):
    """verl's ppo_loss over one rank's mini-batch, split into micro-batches as verl's engine splits it, each loss
    back-propagated as the engine does. Returns the micro-batch losses, the gradient with respect to ``log_probs``
    (0 exactly where a token left the loss) and each micro-batch's metrics."""
    rows = response_mask.shape[0]
    micro_batch_size = micro_batch_size or rows
    leaf = log_probs.clone().requires_grad_(True)
    advantages = torch.as_tensor(advantages, dtype=torch.float64)
    data = actor_mini_batch(
        log_probs,
        advantages,
        response_mask,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    config = actor_config(loss_mode, loss_agg_mode, micro_batch_size)
    losses, metrics = [], []
    for micro_batch in actor_micro_batches(data, micro_batch_size):
        rows_here = micro_batch.rows
        output = model_output(micro_batch.data, leaf[rows_here], entropies[rows_here])
        loss, micro_metrics = ppo_loss(config, output, micro_batch.data)
        loss.backward()
        losses.append(loss.detach())
        metrics.append(micro_metrics)
    return losses, leaf.grad, metrics


def metric(metrics: dict, name: str):
    """One micro-batch's value of a metric, or None when it was not logged."""
    value = metrics.get(name)
    return None if value is None else value.values[0]
