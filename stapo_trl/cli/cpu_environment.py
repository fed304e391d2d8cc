"""Environment variables that `stapo-trl train` sets for torch before torch loads, unless you set them yourself.

- ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP worker threads sleep when a parallel region ends instead of spinning
  for it to start again. A spinning thread burns a core; when other processes share the cores, it also takes them
  from the thread that has work, and a run's CPU time and wall time both grow several-fold (docs/benchmarks.md).
- ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks the kernel for transparent huge pages for large tensors,
  which cuts the minor page faults of fresh activations and buffers.

Both are read once, when torch's libraries load, so they are set only when torch is not imported yet, and only for
``train``. A variable you set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``THP_MEM_ALLOC_ENABLE``, any value) is left
as it is; ``STAPO_TRL_CPU_ENVIRONMENT=0`` leaves them all alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SWITCH = "STAPO_TRL_CPU_ENVIRONMENT"
CPU_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"}
OVERRIDDEN_BY = {"OMP_WAIT_POLICY": ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"), "THP_MEM_ALLOC_ENABLE": ()}
"""Variables that, when set by the user, leave each default unset."""


def set_cpu_environment(
    environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None
) -> dict[str, str]:
    """Set the defaults of `CPU_ENVIRONMENT` that apply; returns what was set."""
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if torch_loaded or environ.get(SWITCH, "1") == "0":
        return {}
    chosen = {}
    for name, value in CPU_ENVIRONMENT.items():
        if name in environ or any(other in environ for other in OVERRIDDEN_BY[name]):
            continue
        environ[name] = chosen[name] = value
    return chosen
