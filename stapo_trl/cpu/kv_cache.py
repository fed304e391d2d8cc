"""A key/value cache for `generate()` whose full-attention layers grow in place, in buffers with room to spare, not by
``torch.cat`` at each step (docs/training.md). On the CPU the logits, so a seed's tokens, are bit-identical."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..trl_boundary.helpers import DECODER_CACHE_ARGUMENT
from .frozen_layer_replay import wrap_methods

GIVEN_CACHE_ARGUMENTS = (DECODER_CACHE_ARGUMENT, "past_key_values")


class InPlaceLayer(DynamicLayer):
    """A `DynamicLayer` whose ``keys`` and ``values`` are views of the first ``get_seq_length()`` positions of
    ``[batch, heads, capacity, head_dim]`` buffers, which double when full; when something other than `update` or
    `reorder_cache` replaces them (``crop``, offloading), the next `update` copies them into new buffers."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
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
            buffers.append(cached.new_empty((*cached.shape[:2], positions, cached.shape[3])))
            buffers[-1][:, :, :filled].copy_(cached)
        self._buffers = tuple(buffers)
        self.keys, self.values = (buffer[:, :, :filled] for buffer in self._buffers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
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
            return super().reorder_cache(beam_idx)
        filled = self.get_seq_length()
        self._buffers = tuple(buffer.index_select(0, beam_idx.to(buffer.device)) for buffer in self._buffers)
        self.keys, self.values = (buffer[:, :, :filled] for buffer in self._buffers)

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def inplace_cache(model: torch.nn.Module, capacity: int) -> DynamicCache:
    """The `DynamicCache` `generate()` would build for ``model``, an `InPlaceLayer` for each plain `DynamicLayer`."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = InPlaceLayer(capacity)
    return cache


def _inplace_capacity(model: torch.nn.Module, args: tuple, kwargs: dict) -> int | None:
    """The positions one row can reach in this `generate()` call (prompt plus ``max_new_tokens``, 0 when unknown);
    None when the call does not leave the cache to transformers' default `DynamicCache`."""
    if any(kwargs.get(name) is not None for name in GIVEN_CACHE_ARGUMENTS):
        return None
    call_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    model_config = getattr(model, "generation_config", None)
    for source in [kwargs, *(vars(config) for config in (call_config, model_config) if config is not None)]:
        if source.get("cache_implementation") is not None or source.get("use_cache") is False:
            return None
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if not (supports and supports()):
        return None
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    max_new_tokens = kwargs.get("max_new_tokens", getattr(call_config or model_config, "max_new_tokens", None))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or max_new_tokens is None:
        return 0
    return input_ids.shape[1] + int(max_new_tokens)


@contextmanager
def inplace_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model.generate`` (for PEFT, the base model's) builds its cache with `inplace_cache` when the
    model is on the CPU and the call leaves the cache to transformers."""

    def generate_with_inplace_cache(generate, *args, **kwargs):
        on_cpu = all(parameter.device.type == "cpu" for parameter in model.parameters())
        if on_cpu and (capacity := _inplace_capacity(model, args, kwargs)) is not None:
            kwargs[DECODER_CACHE_ARGUMENT] = inplace_cache(model, capacity)
        return generate(*args, **kwargs)

    restore = wrap_methods(model, generate=generate_with_inplace_cache)
    try:
        yield
    finally:
        restore()
