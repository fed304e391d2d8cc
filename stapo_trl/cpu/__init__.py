"""Every CPU-only speed-up of stapo-trl, behind one entry: `cpu_runtime` (in `runtime`).

- `lm_head`: TRL's fused LM head scoring only the labelled positions, with the op of `logprob_entropy` (which is
  also the ``torch`` statistics backend of `stapo_trl.fused_stats`).
- `frozen_layer_replay`: the prefill shared between a prompt's samples, and the frozen bottom layers' hidden states
  from `generate()` replayed in the loss pass.
- `colocated_vllm`: TRL's colocated vLLM on vLLM's CPU backend.
- `environment`: the environment variables torch reads when it loads (``OMP_WAIT_POLICY``,
  ``THP_MEM_ALLOC_ENABLE``).

``with cpu_runtime(args): ...`` turns on what applies, for `stapo-trl train` and for your own script alike. Names
load on first access: importing this package (or `environment`, which the command line sets before torch loads)
imports neither torch nor TRL.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_LAZY = {"CPURuntime": ".runtime", "cpu_runtime": ".runtime", "set_cpu_environment": ".environment"}

if TYPE_CHECKING:
    from .environment import set_cpu_environment
    from .runtime import CPURuntime, cpu_runtime


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CPURuntime", "cpu_runtime", "set_cpu_environment"]
