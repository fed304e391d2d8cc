"""Every assignment stapo-trl makes to a global of a TRL, vLLM or transformers module (and the one to torch's that
undoes vLLM's). Nothing runs at import: the CPU runtime (`stapo_trl.cpu`) enters each patch, undone when its block ends
or by the function it returns; the TRL code each relies on is a seam of `stapo_trl.trl_boundary.drift_checks`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import trl.generation.vllm_generation as trl_vllm_generation
import trl.trainer.grpo_trainer as trl_grpo_trainer
import trl.trainer.utils as trl_trainer_utils


def fused_head_op() -> Any:
    """The op `add_fused_lm_head`'s forward calls: TRL's ``ChunkedLogProbFunction`` unless replaced."""
    return trl_trainer_utils._ChunkedLogProbFunction


def install_fused_head_op(op: Any) -> Callable[[], None]:
    """Replaces ``trl.trainer.utils._ChunkedLogProbFunction`` with ``op`` and ``trl.trainer.utils._use_triton`` with
    a test also true on the CPU, so that every fused head (patched before or after) calls ``op.apply`` on only the
    labelled positions; returns the function that puts both back. Seam: install_fused_head_op."""
    previous_op, previous_compact = trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or previous_compact(device)

    trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = op, compact

    def restore() -> None:
        trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = previous_op, previous_compact

    return restore


@contextmanager
def vllm_engine_options(**options) -> Iterator[None]:
    """Replaces ``trl.generation.vllm_generation.LLM`` while the block runs with a function that adds ``options`` to
    TRL's keyword arguments. Seam: colocated vLLM on CPU, engine construction."""
    original = trl_vllm_generation.LLM
    trl_vllm_generation.LLM = lambda *args, **kwargs: original(*args, **{**kwargs, **options})
    try:
        yield
    finally:
        trl_vllm_generation.LLM = original


@contextmanager
def grpo_vllm_generation(factory: Callable[..., Any]) -> Iterator[None]:
    """Replaces ``trl.trainer.grpo_trainer.VLLMGeneration``, the name ``GRPOTrainer.__init__`` builds its engine by,
    with ``factory`` while the block runs. Seam: colocated vLLM on CPU, engine construction."""
    original = trl_grpo_trainer.VLLMGeneration
    trl_grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        trl_grpo_trainer.VLLMGeneration = original


@contextmanager
def torch_threads_kept_from_vllm() -> Iterator[None]:
    """Puts back ``torch.set_num_threads`` and torch's thread count after the block, where vLLM's CPU worker may
    replace them. Seam: colocated vLLM on CPU, worker threads."""
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
