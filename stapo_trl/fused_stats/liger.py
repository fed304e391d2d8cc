"""Liger's fused linear cross-entropy with entropy output (``liger-kernel>=0.8.5``).

On sm90 GPUs (H100/H200) Liger runs a CuTe DSL kernel, which needs ``liger-kernel[cutedsl]``, bf16 inputs and no
bias. Everywhere else, the CPU included, it runs a pure-torch fallback in 512-token chunks.
"""

from __future__ import annotations

import importlib.util

import torch

INSTALL_HINT = "pip install -e '.[liger]' (in the stapo-trl clone)"


def is_liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_unavailable() -> str | None:
    """Why the 'liger' backend cannot run here (what to install), or None when liger-kernel is installed. The one
    check that the config, the backend resolver and the op itself use."""
    if is_liger_available():
        return None
    return f"the 'liger' statistics backend needs liger-kernel>=0.8.5, which is not installed: {INSTALL_HINT}"


def liger_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log_probs [N], entropies [N])`` via ``LigerFusedLinearScaledCrossEntropyFunction``.

    Liger needs the hidden states and the weight in one dtype, so the weight is cast to the hidden states' dtype when
    they differ (for example an fp32 master weight under bf16 autocast).
    """
    problem = liger_unavailable()
    if problem is not None:
        raise ImportError(problem[0].upper() + problem[1:] + ".")
    if bias is not None:
        raise ValueError(
            "Liger's fused linear cross-entropy has no bias term; this LM head has one. Use the 'torch' backend."
        )
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction

    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    nll, entropies = LigerFusedLinearScaledCrossEntropyFunction.apply(
        hidden.contiguous(), weight, targets.long(), float(temperature), -100, 1, True
    )
    return -nll.float(), entropies.float()
