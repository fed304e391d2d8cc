"""stapo-trl's CPU path for TRL's fused LM head, opt-in as Liger's ``apply_liger_kernel_to_*`` functions are.

TRL's trainers (`GRPOTrainer`, and so `STAPOTrainer`; also SFT, DPO, KTO, RLOO) patch the model with
``trl.trainer.utils.add_fused_lm_head``, which computes per-token log-probabilities and entropies with TRL's
``ChunkedLogProbFunction``: Triton on GPUs, and on the CPU a torch fallback that scores every position, prompt and
padding included, in 4096 x 32768 tiles with several full-tile temporaries each. `apply_cpu_lm_head` makes that head
score only the labelled positions on the CPU, with `CPULogProbEntropy` (see :mod:`stapo_trl.fused_stats.blocked`).
Results agree with TRL's fallback to float tolerance (``tests/unit/test_cpu_head.py``).

Importing stapo_trl changes nothing. ``stapo-trl train`` turns the CPU head on for runs on the CPU, whatever the method
(``cpu_lm_head: false`` turns it off). In your own script::

    from stapo_trl.cpu_head import apply_cpu_lm_head, revert_cpu_lm_head, cpu_lm_head

    apply_cpu_lm_head()        # from now on; revert_cpu_lm_head() undoes it
    with cpu_lm_head():        # or only inside the block
        trainer.train()

It applies process-wide, to models patched before or after the call. GPUs, autocast, the head's other outputs
(``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) and a DeepSpeed ZeRO-3 partitioned head still run TRL's op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..fused_stats.blocked import DEFAULT_BLOCK_ROWS, DEFAULT_KEEP_LOGITS_BYTES, CPULogProbEntropy, cpu_logprob_entropy
from ..trl_boundary.patches import fused_head_op, install_fused_head_op
from .op import FusedHeadOp

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


__all__ = [
    "CPULogProbEntropy",
    "FusedHeadOp",
    "apply_cpu_lm_head",
    "cpu_lm_head",
    "cpu_logprob_entropy",
    "is_cpu_lm_head_applied",
    "revert_cpu_lm_head",
]
