"""stapo-trl's CPU path for TRL's fused LM head (docs/training.md).

TRL's trainers patch the model with ``trl.trainer.utils.add_fused_lm_head``, whose op (``ChunkedLogProbFunction``)
falls back on the CPU to a torch path that scores every position, prompt and padding included, in large tiles.
`apply_cpu_lm_head` makes that head score only the labelled positions on the CPU, with `CPULogProbEntropy`
(`stapo_trl.core.token_stats.torch_backend`), for models patched before or after the call, process-wide; results
agree with TRL's fallback to float tolerance. Importing stapo-trl changes nothing; `stapo_trl.cpu.cpu_runtime` turns
it on for its block when the arguments train on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from ..core.token_stats.torch_backend import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_KEEP_LOGITS_BYTES,
    CPULogProbEntropy,  # noqa: F401 - re-exported for the CPU head's users
    cpu_logprob_entropy,
)
from ..trl_boundary.patches import fused_head_op, install_fused_head_op

HANDLED_OUTPUTS = frozenset({"entropy"})
"""TRL's optional outputs this op computes; a request for any other goes to TRL's op."""


def handles(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, outputs: tuple[str, ...]) -> bool:
    """Whether `CPULogProbEntropy` computes this call rather than TRL's op (see `FusedHeadOp`)."""
    tensors = [hidden, weight] + ([] if bias is None else [bias])
    return (
        all(tensor.device.type == "cpu" for tensor in tensors)
        and hidden.dtype in (torch.float32, torch.float64)
        and all(tensor.dtype == hidden.dtype for tensor in tensors)
        and not torch.is_autocast_enabled("cpu")
        and set(outputs) <= HANDLED_OUTPUTS
        and not any(hasattr(tensor, "ds_id") for tensor in tensors)
    )


@dataclass(eq=False)
class FusedHeadOp:
    """A drop-in for TRL's ``ChunkedLogProbFunction`` in `add_fused_lm_head`: same ``apply`` arguments and outputs.
    `CPULogProbEntropy` computes CPU tensors in fp32 or fp64 outside autocast when only log-probabilities and
    entropies are asked for; everything else (GPUs, autocast, other outputs, a ZeRO-3 partitioned head) goes to
    ``fallback``, TRL's op."""

    fallback: Any
    _: KW_ONLY
    block_rows: int = DEFAULT_BLOCK_ROWS
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES

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


_restore: Callable[[], None] | None = None
_settings: dict | None = None


def apply_cpu_lm_head(
    *, block_rows: int = DEFAULT_BLOCK_ROWS, keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES
) -> None:
    """Route TRL's fused LM head through `CPULogProbEntropy` on the CPU. Calling it again replaces the settings.

    Args:
        block_rows: tokens per block of the projection.
        keep_logits_bytes: when a forward records a graph and its ``[N, V]`` transformed logits take at most this
            many bytes, they are kept for the backward, which then skips recomputing the projection. 0 always
            recomputes.
    """
    global _restore, _settings
    revert_cpu_lm_head()
    settings = {"block_rows": block_rows, "keep_logits_bytes": keep_logits_bytes}
    _restore = install_fused_head_op(FusedHeadOp(fused_head_op(), **settings))
    _settings = settings


def revert_cpu_lm_head() -> None:
    """Put TRL's own fused LM head back. Does nothing when the CPU head is off."""
    global _restore, _settings
    if _restore is not None:
        _restore()
    _restore = _settings = None


def is_cpu_lm_head_applied() -> bool:
    return _restore is not None


@contextmanager
def cpu_lm_head(**settings) -> Iterator[None]:
    """The CPU head inside the block (settings as in `apply_cpu_lm_head`); afterwards, the state before it."""
    before = _settings
    apply_cpu_lm_head(**settings)
    try:
        yield
    finally:
        if before is None:
            revert_cpu_lm_head()
        else:
            apply_cpu_lm_head(**before)
