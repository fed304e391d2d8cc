"""Helpers that each touch one private name of TRL or transformers, so that the rest of the package does not."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PretrainedConfig, Trainer

TRL_REWARD_COUNT_MESSAGE = "The reward function '"  # how TRL's refusal of a reward function's output starts


def save_model_without_push(trainer: Trainer, output_dir: str) -> None:
    """``trainer.save_model(output_dir)`` without the Hub push that transformers makes from it when ``push_to_hub``."""
    trainer.save_model(output_dir, _internal_call=True)


def iter_vllm_weights(generation) -> Any:
    """The ``(name, tensor)`` pairs TRL's `VLLMGeneration` pushes into vLLM on a weight sync (PEFT adapters merged)."""
    return generation._iter_named_params()


def set_model_name_or_path(config: PretrainedConfig, name: str) -> None:
    """Set the name transformers and TRL's model card read as the model's source (the config's ``_name_or_path``)."""
    config._name_or_path = name


def missing(source: str, *needles: str) -> list[str]:
    """A problem for each of ``needles`` that ``source`` no longer contains."""
    return [f"no longer contains {needle}" for needle in needles if needle not in source]


# How transformers' decoder-only backbones run their layers, and the keyword their layers receive the KV cache by.
DECODER_LOOP = ("decoder_layer in", "self.layers[: self.config.num_hidden_layers]", "hidden_states = decoder_layer(")
DECODER_CACHE_ARGUMENT = "cache"


def decoder_layer_cache(layer_kwargs: dict[str, Any]) -> Any:
    """The KV cache a decoder layer was called with when its per-layer entries can be re-indexed along the batch (not
    offloaded); otherwise None."""
    cache = layer_kwargs.get(DECODER_CACHE_ARGUMENT)
    reorderable = isinstance(getattr(cache, "layers", None), list) and not getattr(cache, "offloading", False)
    return cache if reorderable else None


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.ModuleList | None, list[str]]:
    """The decoder layers of a causal LM's backbone (``model.base_model.layers``) when its forward runs them as
    `DECODER_LOOP` says; else ``(None, why not)``."""
    backbone = getattr(model, "base_model", None)
    if not isinstance(layers := getattr(backbone, "layers", None), torch.nn.ModuleList):
        return None, [f"{type(model).__name__} has no decoder layer list at base_model.layers"]
    label = f"{type(backbone).__name__}.forward"
    try:
        source = inspect.getsource(type(backbone).forward)
    except (OSError, TypeError):
        return None, [f"{label} has no readable source"]
    problems = [f"{label} {problem}" for problem in missing(source, *DECODER_LOOP)]
    return (None, problems) if problems else (layers, [])
