"""The naive reference: full ``[N, V]`` logits through autograd. For tests and benchmarks, not for training."""

from __future__ import annotations

import torch


def naive_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs [N], entropies [N])`` from materialized logits, in ``promote_types(dtype, float32)``."""
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropies
