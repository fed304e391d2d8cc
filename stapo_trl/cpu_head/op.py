"""The op that TRL's fused LM head calls, with `CPULogProbEntropy` in place of TRL's torch tiles where it applies.

`FusedHeadOp.apply` takes the arguments of TRL's ``ChunkedLogProbFunction.apply`` and returns its five outputs. It
runs `CPULogProbEntropy` for CPU tensors in fp32 or fp64 outside autocast, when only log-probabilities and entropies
are asked for; everything else (GPUs, autocast, the other outputs, a DeepSpeed ZeRO-3 partitioned head) goes to
TRL's own op unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from ..fused_stats.blocked import DEFAULT_BLOCK_ROWS, DEFAULT_KEEP_LOGITS_BYTES, cpu_logprob_entropy

HANDLED_OUTPUTS = frozenset({"entropy"})
"""TRL's optional outputs this op computes; a request for any other goes to TRL's op."""


def handles(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, outputs: tuple[str, ...]) -> bool:
    """Whether `CPULogProbEntropy` computes this call rather than TRL's op."""
    tensors = [hidden, weight] + ([] if bias is None else [bias])
    return (
        all(tensor.device.type == "cpu" for tensor in tensors)
        and hidden.dtype in (torch.float32, torch.float64)
        and all(tensor.dtype == hidden.dtype for tensor in tensors)
        and not torch.is_autocast_enabled("cpu")
        and set(outputs) <= HANDLED_OUTPUTS
        and not any(hasattr(tensor, "ds_id") for tensor in tensors)
    )


class FusedHeadOp:
    """A drop-in for TRL's ``ChunkedLogProbFunction`` in `add_fused_lm_head`: same ``apply`` arguments, same outputs."""

    def __init__(
        self,
        fallback: Any,
        *,
        block_rows: int = DEFAULT_BLOCK_ROWS,
        keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
    ):
        self.fallback = fallback
        self.block_rows = block_rows
        self.keep_logits_bytes = keep_logits_bytes

    def apply(
        self,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ):
        if not handles(hidden, weight, bias, tuple(outputs)):
            return self.fallback.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        log_probs, entropies = cpu_logprob_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            softcap=final_logit_softcapping,
            logit_scale=logit_scale,
            want_entropy="entropy" in outputs,
            block_rows=self.block_rows,
            keep_logits_bytes=self.keep_logits_bytes,
        )
        return log_probs, entropies, None, None, None
