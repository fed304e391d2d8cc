"""Every assignment stapo-trl makes to a global of a TRL, vLLM or transformers module, with what it replaces, why, and
how it is put back; and the one to torch's that undoes vLLM's.

Nothing here runs at import. Each patch is entered by the CPU runtime (`stapo_trl.cpu`) and undone when its block
ends, or by the function it returns. `tests/repository/test_trl_patches.py` fails on such an assignment anywhere else
in the package; the TRL code each one relies on is checked by a seam of `stapo_trl.trl_boundary.drift_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import trl.generation.vllm_generation as trl_vllm_generation
import trl.trainer.grpo_trainer as trl_grpo_trainer
import trl.trainer.utils as trl_trainer_utils


def fused_head_op() -> Any:
    """The op `add_fused_lm_head`'s forward calls for its per-token statistics: TRL's ``ChunkedLogProbFunction``
    unless `install_fused_head_op` replaced it."""
    return trl_trainer_utils._ChunkedLogProbFunction


def install_fused_head_op(op: Any) -> Callable[[], None]:
    """Replaces ``trl.trainer.utils._ChunkedLogProbFunction`` with ``op`` and ``trl.trainer.utils._use_triton`` with
    a test that is also true on the CPU. Returns the function that puts both back.

    Why: every model patched by `add_fused_lm_head` (now or before) then calls ``op.apply`` in place of TRL's
    ``ChunkedLogProbFunction.apply``, with the same arguments, and passes it only the labelled positions on the CPU,
    as TRL does on Triton devices (TRL's CPU path scores every position, prompt and padding included, and zeroes the
    unlabelled ones afterwards). TRL's forward looks both names up in `trl.trainer.utils` at each call, so the swap
    reaches models patched before it; GPUs keep TRL's test, so only the CPU path changes. Seam: the fused head."""
    previous_op, previous_compact = trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or previous_compact(device)

    trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = op, compact

    def restore() -> None:
        trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = previous_op, previous_compact

    return restore


@contextmanager
def vllm_engine_options(**options) -> Iterator[None]:
    """Replaces ``trl.generation.vllm_generation.LLM`` (vLLM's ``LLM`` class, as TRL imported it) with a function that
    builds the same engine with ``options`` added to TRL's keyword arguments, while the block runs.

    Why: in colocate mode, ``VLLMGeneration._init_vllm`` calls ``LLM(...)`` with no dtype, ``enforce_eager`` or KV
    cache size, which vLLM's CPU backend needs chosen (see `stapo_trl.cpu.colocated_vllm`). Seam: colocated vLLM on
    CPU, engine construction."""
    original = trl_vllm_generation.LLM

    def build_llm(*args, **kwargs):
        return original(*args, **{**kwargs, **options})

    trl_vllm_generation.LLM = build_llm
    try:
        yield
    finally:
        trl_vllm_generation.LLM = original


@contextmanager
def grpo_vllm_generation(factory: Callable[..., Any]) -> Iterator[None]:
    """Replaces ``trl.trainer.grpo_trainer.VLLMGeneration`` (TRL's vLLM generation class, as its GRPO module imported
    it) with ``factory`` while the block runs.

    Why: ``GRPOTrainer.__init__`` builds its engine with that name, and there is no argument to pass another class;
    every `GRPOTrainer` (so every `STAPOTrainer`) built inside the block gets ``factory``'s engine and keeps it
    afterwards. Seam: colocated vLLM on CPU, engine construction."""
    original = trl_grpo_trainer.VLLMGeneration
    trl_grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        trl_grpo_trainer.VLLMGeneration = original


@contextmanager
def torch_threads_kept_from_vllm() -> Iterator[None]:
    """Puts back ``torch.set_num_threads`` and torch's thread count after the block, in which vLLM's CPU worker may
    replace them.

    Why: the threads row of docs/vllm.md's "What differs from the GPU path". Seam: colocated vLLM on CPU, worker
    threads."""
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
