"""A key/value cache for `generate()` whose full-attention layers grow in place instead of by concatenation
(docs/training.md). transformers' `DynamicLayer` appends each decoding step with ``torch.cat``, copying the whole cache
of every layer at every step; `InPlaceLayer` writes each step into buffers with room for the positions to come and
hands attention views of the filled part. On the CPU the logits are bit-identical, so a seed samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..trl_boundary.helpers import DECODER_CACHE_ARGUMENT
from .frozen_layer_replay import wrap_methods

GIVEN_CACHE_ARGUMENTS = (DECODER_CACHE_ARGUMENT, "past_key_values")
"""The `generate()` arguments that hand in a cache of the caller's (then `inplace_kv_cache` steps aside)."""


class InPlaceLayer(DynamicLayer):
    """A `DynamicLayer` whose ``keys`` and ``values`` are views of the first ``get_seq_length()`` positions of
    ``[batch, heads, capacity, head_dim]`` buffers, which double when full. When something other than `update` replaces
    them (``crop``, ``batch_select_indices``, offloading), the next `update` copies them into new buffers;
    `reorder_cache` (beam search, the shared prefill) reorders the buffers themselves."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        """Positions the buffers hold when first allocated (at least the first update's)."""
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _views_of_buffers(self) -> bool:
        """Whether ``keys`` and ``values`` are still the views `update` made of the buffers."""
        if self._buffers is None or self.keys is None or self.values is None:
            return False
        return all(
            view.data_ptr() == buffer.data_ptr()
            and view.stride() == buffer.stride()
            and view.shape[0] == buffer.shape[0]
            for view, buffer in zip((self.keys, self.values), self._buffers, strict=True)
        )

    def _allocate(self, positions: int) -> None:
        """New buffers with room for ``positions``, holding what ``keys`` and ``values`` hold now."""
        filled = self.get_seq_length()
        buffers = []
        for cached in (self.keys, self.values):
            batch, heads, _, head_dim = cached.shape
            buffer = cached.new_empty((batch, heads, positions, head_dim))
            if filled:
                buffer[:, :, :filled].copy_(cached)
            buffers.append(buffer)
        self._buffers = tuple(buffers)
        self.keys, self.values = (buffer[:, :, :filled] for buffer in self._buffers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            self._buffers = None
        filled = self.get_seq_length()
        needed = filled + key_states.shape[-2]
        if not self._views_of_buffers():
            self._allocate(max(needed, self.capacity))
        elif needed > self._buffers[0].shape[-2]:
            self._allocate(max(needed, 2 * self._buffers[0].shape[-2]))
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[:, :, filled:needed].copy_(states)
        self.keys, self.values = (buffer[:, :, :needed] for buffer in self._buffers)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self._views_of_buffers():
            super().reorder_cache(beam_idx)
            return
        filled = self.get_seq_length()
        self._buffers = tuple(buffer.index_select(0, beam_idx.to(buffer.device)) for buffer in self._buffers)
        self.keys, self.values = (buffer[:, :, :filled] for buffer in self._buffers)

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def inplace_cache(model: torch.nn.Module, capacity: int) -> DynamicCache:
    """The `DynamicCache` `generate()` would build for ``model``, with each plain full-attention `DynamicLayer`
    replaced by an `InPlaceLayer` of ``capacity`` positions (other layer kinds kept)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = InPlaceLayer(capacity)
    return cache


def _generation_config_of_call(args: tuple, kwargs: dict):
    """The ``generation_config`` a `generate(inputs, generation_config, ...)` call passes, by keyword or by position."""
    return kwargs.get("generation_config", args[1] if len(args) > 1 else None)


def _cache_left_to_transformers(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this `generate()` call leaves the cache to transformers' default `DynamicCache`: none handed in, no
    ``cache_implementation`` or ``use_cache=False``, and a model that takes the default cache."""
    if any(kwargs.get(name) is not None for name in GIVEN_CACHE_ARGUMENTS):
        return False
    configs = [_generation_config_of_call(args, kwargs), getattr(model, "generation_config", None)]
    for source in [kwargs, *(vars(config) for config in configs if config is not None)]:
        if source.get("cache_implementation") is not None or source.get("use_cache") is False:
            return False
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return bool(supports and supports())


def _capacity(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The positions one row can reach in this call: the prompt's length plus ``max_new_tokens`` (0 when unknown)."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    config = _generation_config_of_call(args, kwargs) or getattr(model, "generation_config", None)
    max_new_tokens = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or max_new_tokens is None:
        return 0
    return input_ids.shape[1] + int(max_new_tokens)


@contextmanager
def inplace_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model.generate`` (the transformers model; for PEFT, its base model) builds its cache with
    `inplace_cache` when the model is on the CPU and the call leaves the cache to transformers."""

    def with_inplace_cache(generate):
        def generate_with_inplace_cache(*args, **kwargs):
            on_cpu = all(parameter.device.type == "cpu" for parameter in model.parameters())
            if on_cpu and _cache_left_to_transformers(model, args, kwargs):
                kwargs[DECODER_CACHE_ARGUMENT] = inplace_cache(model, _capacity(model, args, kwargs))
            return generate(*args, **kwargs)

        return generate_with_inplace_cache

    restore = wrap_methods(model, generate=with_inplace_cache)
    try:
        yield
    finally:
        restore()
