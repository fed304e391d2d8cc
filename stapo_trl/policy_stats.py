"""Per-token ``(log p, H)`` of a TRL batch under the trainer's current policy: the statistics backend that suits the
model, and the no-grad pass that computes them when neither TRL's passes nor generation provide them.

The pass runs without gradients, with dropout off and the random streams untouched, in chunks of
``per_device_train_batch_size`` sequences. The ``"model_head"`` backend runs the whole model, its own LM head
included, through TRL's fused head (the trainer's `per_token_logps_and_entropies`); the others run the backbone and
hand its hidden states and the LM head to :func:`stapo_trl.fused_stats.token_logprob_entropy`.
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import is_peft_model

from .fused_stats import resolve_backend, token_logprob_entropy
from .trl_seams import disable_gradient_checkpointing, maybe_gather_lm_head_ctx

logger = logging.getLogger(__name__)

MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
"""Batch keys that TRL's per-token pass takes for vision-language inputs."""
LOGIT_TRANSFORM_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)
"""Config attributes with which TRL's fused head rescales or soft-caps logits; the direct backends do neither."""


def policy_parts(trainer) -> tuple[Any, Any, torch.nn.Module]:
    """The transformers model under any DDP/PEFT wrapping, its backbone and its LM head."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
    return base, base.base_model, base.get_output_embeddings()


def logit_transforms(model) -> list[str]:
    """The attributes of ``model``'s text config that transform logits after the LM head."""
    text_config = model.config.get_text_config()
    return [name for name in LOGIT_TRANSFORM_ATTRIBUTES if getattr(text_config, name, None) is not None]


def sharding(trainer) -> str | None:
    """Why the LM head may be sharded outside its module's forward (FSDP, ZeRO-3), or None."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if trainer.is_fsdp_enabled:
        return "FSDP"
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3"
    return None


def resolve_token_stats_backend(trainer) -> str:
    """The backend for ``trainer.args.token_stats_backend``: ``"auto"`` picks TRL's fused head where the direct
    backends do not cover the model (logit transforms, vision-language inputs, a sharded head); an explicit direct
    backend on such a model is refused, or warned about under sharding."""
    requested = trainer.args.token_stats_backend
    if requested == "model_head":
        return "model_head"
    base, _, lm_head = policy_parts(trainer)
    blockers = logit_transforms(base)
    if trainer.is_vision_language_model:
        blockers.append("vision-language inputs")
    if blockers:
        if requested == "auto":
            return "model_head"
        raise ValueError(
            f"token_stats_backend={requested!r} computes statistics from the backbone's hidden states and the LM "
            f"head alone, which does not cover this model ({', '.join(blockers)}). Use token_stats_backend='model_head' "
            "(the model's own TRL fused head) or 'auto'."
        )
    sharded = sharding(trainer)
    if sharded is not None:
        if requested == "auto":
            return "model_head"
        logger.warning(
            "token_stats_backend=%r under %s gathers the LM head outside the model's forward; this path is not "
            "covered by stapo-trl's tests. token_stats_backend='model_head' (what 'auto' picks here) is.",
            requested,
            sharded,
        )
    return resolve_backend(requested, trainer.accelerator.device, has_bias=lm_head.bias is not None)


@contextmanager
def side_effect_free_pass(model: torch.nn.Module):
    """Run a forward that changes nothing but its result: dropout off (every module in eval mode, each module's mode
    restored afterwards), and the torch, CUDA, NumPy and Python random streams forked, so that the training run draws
    the same numbers with or without this pass."""
    import numpy as np

    modes = [(module, module.training) for module in model.modules()]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_devices):
        model.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@torch.no_grad()
def compute_token_stats(trainer, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(log_probs, entropies)`` ``[B, C]`` of the completions in a TRL batch under ``trainer``'s current
    policy, with its ``token_stats_backend``. Padding positions get 0."""
    with side_effect_free_pass(trainer.model):
        return _token_stats_forward(trainer, batch)


def _token_stats_forward(trainer, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    completion_mask = batch["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
    num_completion_tokens = completion_ids.size(1)
    chunk = trainer.args.per_device_train_batch_size

    with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if trainer.token_stats_backend == "model_head":
            multimodal = {key: batch[key] for key in MULTIMODAL_KEYS if batch.get(key) is not None}
            log_probs, entropies, _ = trainer.per_token_logps_and_entropies(
                trainer.model,
                input_ids,
                attention_mask,
                num_completion_tokens,
                batch_size=chunk,
                compute_entropy=True,
                **multimodal,
            )
            return log_probs, entropies

        _, backbone, lm_head = policy_parts(trainer)
        weight, bias = lm_head.weight, lm_head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 shards parameters as DTensors
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        targets = completion_ids.masked_fill(completion_mask == 0, -100)
        log_probs, entropies = [], []
        for start in range(0, input_ids.size(0), chunk):
            end = start + chunk
            with trainer.accelerator.autocast():
                hidden = backbone(
                    input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], use_cache=False
                ).last_hidden_state
            # The hidden state at position j predicts token j + 1.
            hidden = hidden[:, -num_completion_tokens - 1 : -1].to(weight.device)
            with maybe_gather_lm_head_ctx(weight, bias):
                chunk_log_probs, chunk_entropies = token_logprob_entropy(
                    hidden,
                    weight,
                    targets[start:end].to(weight.device),
                    bias=bias,
                    temperature=trainer.temperature,
                    backend=trainer.token_stats_backend,
                )
            log_probs.append(chunk_log_probs.float())
            entropies.append(chunk_entropies.float())
    device = completion_ids.device
    return torch.cat(log_probs).to(device), torch.cat(entropies).to(device)
