"""Fused statistics backends: per-token log p and entropy from hidden states and the LM-head weight.

None of the training backends materializes ``[N, V]`` logits. All are differentiable and return fp32 (or fp64 for
fp64 inputs), with the temperature applied to the logits as in sampling.

===============  ===============================================================  ==================================
name             what                                                             where it is the default
===============  ===============================================================  ==================================
``liger``        Liger's ``LigerFusedLinearScaledCrossEntropyFunction``           CUDA, when liger-kernel is installed
``torch``        the CPU head's blocked op, logits never kept (:mod:`stapo_trl.cpu.logprob_entropy`) everywhere else (CPU)
``trl_chunked``  TRL's ``ChunkedLogProbFunction`` (its fused head's kernel)        never chosen by ``auto``
``naive``        full logits through autograd, for reference only                 never chosen by ``auto``
===============  ===============================================================  ==================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cpu.logprob_entropy import blocked_logprob_entropy
from .liger import is_liger_available, liger_logprob_entropy, liger_unavailable
from .reference import naive_logprob_entropy
from .trl_kernel import trl_logprob_entropy

BackendFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

BACKENDS: dict[str, BackendFn] = {
    "torch": blocked_logprob_entropy,
    "liger": liger_logprob_entropy,
    "trl_chunked": trl_logprob_entropy,
    "naive": naive_logprob_entropy,
}


def backend_unavailable(name: str) -> str | None:
    """Why the backend ``name`` cannot run on this installation (what to install), or None when it can."""
    return liger_unavailable() if name == "liger" else None


def resolve_backend(name: str, device: torch.device | str, *, has_bias: bool = False) -> str:
    """Resolve ``"auto"`` to a concrete backend name and check that the requested one can run."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda" and is_liger_available() and not has_bias:
            return "liger"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"Unknown statistics backend {name!r}; choose one of 'auto', {', '.join(map(repr, BACKENDS))}."
        )
    problem = backend_unavailable(name)
    if problem is not None:
        raise ImportError(problem[0].upper() + problem[1:] + ".")
    return name


def token_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(log_probs, entropies)`` of ``softmax((hidden @ weight.T + bias) / temperature)`` at ``targets``.

    Args:
        hidden: ``[..., H]`` hidden states at the positions that predict ``targets``.
        weight: ``[V, H]`` LM-head weight.
        targets: ``[...]`` token ids; positions equal to ``ignore_index`` are skipped and return 0.
        bias: optional ``[V]`` LM-head bias.
        temperature: the sampling temperature the logits are divided by.
        backend: ``"auto"``, ``"torch"``, ``"liger"``, ``"trl_chunked"`` or ``"naive"``.

    Returns:
        Two tensors shaped like ``targets``: natural-log probabilities and entropies in nats.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must agree on the leading dimensions."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    backend_fn = BACKENDS[resolve_backend(backend, hidden.device, has_bias=bias is not None)]
    valid = targets != ignore_index
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    log_probs = hidden.new_zeros(targets.shape, dtype=out_dtype)
    entropies = hidden.new_zeros(targets.shape, dtype=out_dtype)
    if not valid.any():
        anchor = hidden.sum() * 0
        return log_probs + anchor, entropies + anchor
    valid_log_probs, valid_entropies = backend_fn(
        hidden[valid], weight, targets[valid], bias=bias, temperature=temperature
    )
    log_probs = log_probs.masked_scatter(valid, valid_log_probs.to(out_dtype))
    entropies = entropies.masked_scatter(valid, valid_entropies.to(out_dtype))
    return log_probs, entropies


__all__ = [
    "BACKENDS",
    "backend_unavailable",
    "blocked_logprob_entropy",
    "is_liger_available",
    "liger_logprob_entropy",
    "naive_logprob_entropy",
    "resolve_backend",
    "token_logprob_entropy",
    "trl_logprob_entropy",
]
