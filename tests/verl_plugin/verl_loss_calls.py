"""Calls of verl's own ``ppo_loss`` on given float64 tensors, laid out as verl's actor lays them out, for the verl
plugin's tests. Importing this needs verl."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

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
    layout: str = "v0",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
):
    """verl's ppo_loss over one rank's mini-batch in ``layout`` (v0 or v1 trainer), split into micro-batches as verl's
    engine splits it, each loss back-propagated as the engine does. Returns the micro-batch losses, the gradient with respect to ``log_probs``
    (0 exactly where a token left the loss) and each micro-batch's metrics."""
    rows = response_mask.shape[0]
    micro_batch_size = micro_batch_size or rows
    leaf = log_probs.clone().requires_grad_(True)
    advantages = torch.as_tensor(advantages, dtype=torch.float64)
    data = actor_mini_batch(
        log_probs,
        advantages,
        response_mask,
        layout=layout,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    config = actor_config(loss_mode, loss_agg_mode, micro_batch_size)
    losses, metrics = [], []
    for micro_batch in actor_micro_batches(data, micro_batch_size):
        rows_here = micro_batch["row"]
        output = model_output(micro_batch, leaf[rows_here], entropies[rows_here])
        loss, micro_metrics = ppo_loss(config, output, micro_batch)
        loss.backward()
        losses.append(loss.detach())
        metrics.append(micro_metrics)
    return losses, leaf.grad, metrics


def metric(metrics: dict, name: str):
    """One micro-batch's value of a metric, or None when it was not logged."""
    value = metrics.get(name)
    return None if value is None else value.values[0]


def lm_head_engine(entropy_checkpointing: bool = False):
    """verl's FSDP actor engine (``FSDPEngineWithLMHead``) with only what its ``prepare_model_inputs`` and
    ``prepare_model_outputs`` read, so that those two run on the CPU: no model, no FSDP, no Ulysses, no fused kernels."""
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length = False
    engine.use_ulysses_sp = False
    engine.engine_config = FSDPEngineConfig(entropy_checkpointing=entropy_checkpointing)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def engine_loss(
    logits_of,
    advantages,
    response_mask: torch.Tensor,
    loss_mode: str,
    loss_agg_mode: str = "token-mean",
    *,
    use_remove_padding: bool,
    layout: str,
    micro_batch_size: int,
):
    """verl's ppo_loss on the model output that verl's FSDP engine builds from logits, as its ``forward_step`` does
    (``prepare_model_inputs``, the model, ``prepare_model_outputs``, the loss), with ``use_remove_padding`` packing the
    micro-batch into one row or not. ``logits_of(input_ids, position_ids)`` stands in for the model. A first pass
    without gradient gives the old log-probabilities, as verl's ``compute_log_prob`` does, so the ratio is 1. Every
    micro-batch's loss is back-propagated; returns the losses and each micro-batch's metrics."""
    advantages = torch.as_tensor(advantages, dtype=torch.float64)
    config = actor_config(loss_mode, loss_agg_mode, micro_batch_size)
    engine = lm_head_engine()

    def forward(micro_batch):
        tu.assign_non_tensor(
            micro_batch, use_remove_padding=use_remove_padding, temperature=1.0, calculate_entropy=True
        )
        inputs, output_args = engine.prepare_model_inputs(micro_batch)
        logits = logits_of(inputs["input_ids"], inputs["position_ids"])
        return engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, micro_batch, None)

    old_log_probs = torch.zeros(response_mask.shape, dtype=torch.float64)
    data = actor_mini_batch(old_log_probs, advantages, response_mask, layout=layout)
    with torch.no_grad():
        for micro_batch in actor_micro_batches(data, micro_batch_size):
            padded = no_padding_2_padding(forward(micro_batch)["log_probs"], micro_batch)
            old_log_probs[micro_batch["row"], : padded.shape[1]] = padded

    data = actor_mini_batch(old_log_probs, advantages, response_mask, layout=layout)
    losses, metrics = [], []
    for micro_batch in actor_micro_batches(data, micro_batch_size):
        loss, micro_metrics = ppo_loss(config, forward(micro_batch), micro_batch)
        loss.backward()
        losses.append(loss.detach())
        metrics.append(micro_metrics)
    return losses, metrics
