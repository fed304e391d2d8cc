"""stapo-trl's CPU path for TRL's fused LM head (docs/training.md): `apply_cpu_lm_head` makes every head patched by
TRL's ``add_fused_lm_head`` score only the labelled positions on the CPU with `CPULogProbEntropy`, process-wide, where
TRL's fallback scores every position; results agree to float tolerance. `stapo_trl.cpu.cpu_runtime` turns it on."""

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


def handles(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, outputs: tuple[str, ...]) -> bool:
    """Whether `CPULogProbEntropy` computes this call rather than TRL's op."""
    tensors = [hidden, weight] + ([] if bias is None else [bias])
    return (
        all(tensor.device.type == "cpu" for tensor in tensors)
        and hidden.dtype in (torch.float32, torch.float64)
        and all(tensor.dtype == hidden.dtype for tensor in tensors)
        and not torch.is_autocast_enabled("cpu")
        and set(outputs) <= {"entropy"}
        and not any(hasattr(tensor, "ds_id") for tensor in tensors)
    )


@dataclass(eq=False)
class FusedHeadOp:
    """A drop-in for TRL's ``ChunkedLogProbFunction`` in `add_fused_lm_head`: `CPULogProbEntropy` computes the calls
    it `handles` (CPU, fp32 or fp64, no autocast, no ZeRO-3, only entropies asked for); others go to ``fallback``."""

    fallback: Any
    _: KW_ONLY
    block_rows: int = DEFAULT_BLOCK_ROWS
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        if not handles(hidden, weight, bias, tuple(outputs)):
            return self.fallback.apply(
                hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs
            )
        log_probs, entropies = cpu_logprob_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            softcap=softcap,
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
    """Route TRL's fused LM head through `CPULogProbEntropy` on the CPU; calling it again replaces the settings.
    ``block_rows``: tokens per block of the projection. ``keep_logits_bytes``: a graph-recording forward whose
    ``[N, V]`` logits take at most this many bytes keeps them for the backward instead of recomputing (0: never)."""
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
