"""Environment variables for torch on the CPU, which take effect only when set before torch loads.

- ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP worker threads sleep when a parallel region ends instead of spinning
  for it to start again. A spinning thread burns a core; when other processes share the cores, it also takes them
  from the thread that has work, and a run's CPU time and wall time both grow several-fold (docs/benchmarks.md).
- ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks the kernel for transparent huge pages for large tensors,
  which cuts the minor page faults of fresh activations and buffers.

Both are read once, when torch's libraries load. `stapo-trl train` calls `set_cpu_environment` before it imports
torch; in your own script, call it before anything imports torch (``from stapo_trl.cpu.environment import
set_cpu_environment`` imports neither torch nor TRL), or set the variables in the shell. Once torch is loaded,
`set_cpu_environment` sets nothing, and `cpu_environment_not_in_effect` says which defaults are missing. A variable
you set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``THP_MEM_ALLOC_ENABLE``, any value) is left as it is;
``STAPO_TRL_CPU_ENVIRONMENT=0`` leaves them all alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SWITCH = "STAPO_TRL_CPU_ENVIRONMENT"
CPU_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"}
OVERRIDDEN_BY = {"OMP_WAIT_POLICY": ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"), "THP_MEM_ALLOC_ENABLE": ()}
"""Variables that, when set by the user, leave each default unset."""


def _unset_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The defaults of `CPU_ENVIRONMENT` that neither the environment nor a variable overriding them sets."""
    if environ.get(SWITCH, "1") == "0":
        return {}
    return {
        name: value
        for name, value in CPU_ENVIRONMENT.items()
        if name not in environ and not any(other in environ for other in OVERRIDDEN_BY[name])
    }


def set_cpu_environment(
    environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None
) -> dict[str, str]:
    """Set the defaults of `CPU_ENVIRONMENT` that apply; returns what was set (nothing once torch is loaded)."""
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if torch_loaded:
        return {}
    chosen = _unset_defaults(environ)
    environ.update(chosen)
    return chosen


def cpu_environment_not_in_effect(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The defaults of `CPU_ENVIRONMENT` missing from the environment: neither set (by `set_cpu_environment` or the
    user) nor overridden by a variable of the user's. Empty with ``STAPO_TRL_CPU_ENVIRONMENT=0``. It reads the
    environment as it is now: a variable set after torch loaded counts as present, although torch never read it."""
    return _unset_defaults(os.environ if environ is None else environ)
