"""Per-token log p and entropy recorded while `generate()` samples, at no extra forward.

A forward hook on the LM head forms ``log_softmax(logits / T)`` and its entropy at every decoding step, and a forward
pre-hook on the model keeps the log-probability of the token fed back next (the token just sampled). Only one
``[B, V]`` row is alive at a time. The hooks see the logits before any logits processor, so the statistics are the
policy's own distribution whatever the sampler did; they match a full forward up to the rounding of incremental
decoding (`tests/unit/test_generation_stats.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch

UNRECORDABLE_DECODING = {
    "num_beams": "beam search",
    "num_beam_groups": "group beam search",
    "penalty_alpha": "contrastive search",
    "assistant_model": "assisted generation",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "dola_layers": "DoLa decoding",
}
"""`generate()` options under which the LM head does not run once per sampled token on one row per sequence: beams
multiply and reorder the rows, contrastive search scores extra candidates, assisted and prompt-lookup decoding verify
several tokens per forward, and DoLa runs the head on earlier layers too."""


def unrecordable_decoding(generation_kwargs: Mapping[str, Any] | None) -> str | None:
    """Why `GenerationStatsRecorder` cannot follow `generate()` under these options, or None when it can."""
    for name, mode in UNRECORDABLE_DECODING.items():
        value = (generation_kwargs or {}).get(name)
        if value is None or value is False:
            continue
        if name in ("num_beams", "num_beam_groups") and value == 1:
            continue
        return f"{mode} ({name}={value!r} in generation_kwargs)"
    return None


class GenerationStatsRecorder:
    """Records ``(log_probs, entropies)`` ``[B, steps]`` of the tokens sampled by one `generate()` call.

    Use :meth:`attached` around the call, then :meth:`finish` with the generated completion token ids.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._pending: torch.Tensor | None = None
        self._log_probs: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []
        self._products: torch.Tensor | None = None

    @contextmanager
    def attached(self, model: torch.nn.Module, lm_head: torch.nn.Module):
        """Hook `model` (the transformers model whose forward `generate()` calls) and its `lm_head`."""
        handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            lm_head.register_forward_hook(self._after_lm_head),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before_forward(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self._pending is not None and input_ids is not None:
            self._take(input_ids[:, -1])

    def _after_lm_head(self, module, args, output):
        logits = (output[:, -1, :] if output.dim() == 3 else output).detach().float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        # p * log p in one reused [B, V] buffer: the same values as (exp(log p) * log p), two fewer allocations.
        if self._products is None or self._products.shape != log_probs.shape:
            self._products = torch.empty_like(log_probs)
        self._entropies.append(-torch.exp(log_probs, out=self._products).mul_(log_probs).sum(-1))
        self._pending = log_probs

    def _take(self, tokens: torch.Tensor) -> None:
        self._log_probs.append(self._pending.gather(-1, tokens.to(self._pending.device).long().unsqueeze(-1))[:, 0])
        self._pending = None

    def finish(self, completion_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(log_probs, entropies)`` aligned with ``completion_ids`` ``[B, C]`` (the generated tokens, one column per
        decoding step), or None when the hooks did not see one LM-head call per generated token on one row per
        completion."""
        if self._pending is not None:
            last = len(self._log_probs)
            if last < completion_ids.size(1):
                self._take(completion_ids[:, last])
        rows, columns = completion_ids.shape
        if not self._log_probs or len(self._log_probs) != len(self._entropies) or len(self._log_probs) < columns:
            return None
        recorded = self._log_probs[:columns] + self._entropies[:columns]
        if any(values.dim() != 1 or values.size(0) != rows for values in recorded):
            return None
        return torch.stack(self._log_probs[:columns], dim=1), torch.stack(self._entropies[:columns], dim=1)
