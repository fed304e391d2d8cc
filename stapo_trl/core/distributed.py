"""Collectives used by the token rules: exact global pools and counts across processes.

Every helper is a no-op on a single process, so the token rules stay pure tensor functions that also work in a plain
training loop. When ``torch.distributed`` is initialized, every rank must call the same helpers in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Number of processes in the default group, or 1 when torch.distributed is not initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_variable(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor whose length differs per rank, in rank order, on every rank."""
    if world_size() == 1:
        return values
    local_size = torch.tensor([values.numel()], device=values.device, dtype=torch.long)
    sizes = [torch.zeros_like(local_size) for _ in range(world_size())]
    dist.all_gather(sizes, local_size)
    sizes = [int(size.item()) for size in sizes]
    longest = max(max(sizes), 1)  # some backends reject zero-size collectives
    padded = values.new_zeros(longest)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return torch.cat([chunk[:size] for chunk, size in zip(gathered, sizes, strict=True)])


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (returns a new tensor; the input is left untouched)."""
    total = values.clone()
    if world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of a tensor over all ranks, on the input's device. Under NCCL the reduction runs on
    this process's CUDA device (NCCL reduces only CUDA tensors)."""
    reduced = values.clone()
    if world_size() > 1:
        if dist.get_backend() == "nccl" and reduced.device.type != "cuda":
            reduced = reduced.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.to(values.device)


def rank() -> int:
    """This process's rank in the default group, or 0 when torch.distributed is not initialized."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_objects(value: object) -> list[object]:
    """Every rank's picklable ``value``, in rank order, on every rank (``[value]`` on a single process)."""
    if world_size() == 1:
        return [value]
    gathered: list[object] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered
