"""Per-token log p and entropy from hidden states and the LM-head weight without ``[N, V]`` logits (differentiable,
fp32 out, temperature applied as in sampling), and the backend names `token_logprob_entropy` and
`STAPOConfig.token_stats_backend` share (docs/semantics.md, "Statistics backends").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .liger_backend import liger_logprob_entropy, liger_unavailable
from .torch_backend import blocked_logprob_entropy

logger = logging.getLogger(__name__)

TRL_VOCAB_CHUNK_SIZE = 32768


def trl_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log_probs [N], entropies [N])`` via TRL's ``ChunkedLogProbFunction``, the kernel behind its
    fused LM head: Triton on GPU, torch tiles of 4096 tokens x 32768 vocabulary entries elsewhere."""
    from trl.kernels import ChunkedLogProbFunction  # here, so that importing this package loads no TRL

    log_probs, entropies, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, float(temperature), TRL_VOCAB_CHUNK_SIZE, None, 1.0, ("entropy",)
    )
    return log_probs, entropies


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


BackendFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

TRL_FUSED_HEAD = "trl_fused_head"
BACKENDS: dict[str, BackendFn] = {
    TRL_FUSED_HEAD: trl_logprob_entropy,
    "torch": blocked_logprob_entropy,
    "liger": liger_logprob_entropy,
    "naive": naive_logprob_entropy,
}
"""Every backend by name, with the function `token_logprob_entropy` runs for it."""
TOKEN_STATS_BACKENDS = ("auto", *(name for name in BACKENDS if name != "naive"))
"""The names `STAPOConfig.token_stats_backend` takes: ``"auto"`` and every backend but the reference."""


def backend_unavailable(name: str, device: torch.device | str | None = None) -> str | None:
    """Why the backend ``name`` cannot run on this installation (on ``device``, when given), with what to install, or
    None when it can."""
    return liger_unavailable(device) if name == "liger" else None


def resolve_backend(
    name: str,
    device: torch.device | str,
    *,
    has_bias: bool = False,
    not_covered: Sequence[str] = (),
    sharded_by: str | None = None,
    option: str = "backend",
) -> str:
    """The backend ``name`` stands for: ``"auto"`` resolved (``liger`` on CUDA where it can run and the head has no
    bias, else ``torch``; ``trl_fused_head`` when ``not_covered`` names why hidden states and the head's weight do not
    give the logits, or ``sharded_by`` names what shards the head), an unknown name or a missing install refused.
    """
    if name != "auto" and name not in BACKENDS:
        raise ValueError(
            f"Unknown statistics backend {name!r}; choose one of 'auto', {', '.join(map(repr, BACKENDS))}."
        )
    if name == TRL_FUSED_HEAD or (name == "auto" and (not_covered or sharded_by is not None)):
        return TRL_FUSED_HEAD
    if not_covered:
        raise ValueError(
            f"{option}={name!r} computes statistics from the backbone's hidden states and the LM head alone, which "
            f"does not cover this model ({', '.join(not_covered)}). Use {option}={TRL_FUSED_HEAD!r} (the model's own "
            "TRL fused head) or 'auto'."
        )
    if sharded_by is not None:
        logger.warning(
            "%s=%r under %s gathers the LM head outside the model's forward; this path is not covered by stapo-trl's "
            "tests. %s=%r (what 'auto' picks here) is.",
            option,
            name,
            sharded_by,
            option,
            TRL_FUSED_HEAD,
        )
    if name == "auto":
        usable = torch.device(device).type == "cuda" and liger_unavailable(device) is None and not has_bias
        return "liger" if usable else "torch"
    problem = backend_unavailable(name, device)
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
        backend: ``"auto"`` or a name of `BACKENDS` (see the module docstring).

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
    "TOKEN_STATS_BACKENDS",
    "TRL_FUSED_HEAD",
    "backend_unavailable",
    "naive_logprob_entropy",
    "resolve_backend",
    "token_logprob_entropy",
    "trl_logprob_entropy",
]
