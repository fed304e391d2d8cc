"""Liger's fused linear cross-entropy with entropy output (``liger-kernel>=0.8.5``).

On sm90 GPUs (H100/H200) Liger runs a CuTe DSL kernel, which needs ``liger-kernel[cutedsl]``, bf16 inputs and no
bias. Everywhere else, the CPU included, it runs a pure-torch fallback in 512-token chunks.
"""

from __future__ import annotations

import importlib.util

import torch

INSTALL_HINT = "pip install -e '.[liger]' (in the stapo-trl clone)"
CUTE_DSL_INSTALL_HINT = "pip install 'liger-kernel[cutedsl]'"


def is_liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def takes_cute_dsl_kernel(device: torch.device | str | None) -> bool:
    """Whether Liger runs its CuTe DSL kernel on ``device``: a CUDA device of compute capability 9.0 (H100, H200).
    liger-kernel 0.8.5 then imports ``cutlass`` (nvidia-cutlass-dsl), with no fallback to its torch path."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device)) == (9, 0)


def liger_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why the 'liger' backend cannot run here (what to install), or None when it can: liger-kernel missing, or on
    ``device``, an sm90 GPU, the CuTe DSL package missing. The one check that the config, the backend resolver and the
    op itself use."""
    if not is_liger_available():
        return f"the 'liger' statistics backend needs liger-kernel>=0.8.5, which is not installed: {INSTALL_HINT}"
    if takes_cute_dsl_kernel(device) and importlib.util.find_spec("cutlass") is None:
        return (
            "the 'liger' statistics backend runs Liger's CuTe DSL kernel on this GPU (compute capability 9.0), which "
            f"needs nvidia-cutlass-dsl, not installed: {CUTE_DSL_INSTALL_HINT}"
        )
    return None


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
    problem = liger_unavailable(hidden.device)
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
