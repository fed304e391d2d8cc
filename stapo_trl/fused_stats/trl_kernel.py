"""TRL's own chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``), the one behind its fused LM head.

It runs Triton on GPU and torch tiles of 4096 tokens x 32768 vocabulary entries elsewhere.
"""

from __future__ import annotations

import torch

# TRL is imported when the kernel runs, so that importing `stapo_trl.fused_stats` loads no TRL.

TRL_VOCAB_CHUNK_SIZE = 32768


def trl_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log_probs [N], entropies [N])`` via TRL's ``ChunkedLogProbFunction``."""
    from trl.kernels import ChunkedLogProbFunction

    log_probs, entropies, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, float(temperature), TRL_VOCAB_CHUNK_SIZE, None, 1.0, ("entropy",)
    )
    return log_probs, entropies
