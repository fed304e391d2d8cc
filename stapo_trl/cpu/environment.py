"""Environment variables for torch on the CPU, read only when torch loads (docs/training.md): call
`set_cpu_environment` before anything imports torch (this module imports neither torch nor TRL). A variable you set is
left as it is, and ``STAPO_TRL_CPU_ENVIRONMENT=0`` leaves them all alone."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SWITCH = "STAPO_TRL_CPU_ENVIRONMENT"
CPU_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"}
# Variables that, set by the user, leave each default unset.
OVERRIDDEN_BY = {"OMP_WAIT_POLICY": ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"), "THP_MEM_ALLOC_ENABLE": ()}


def set_cpu_environment(
    environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None
) -> dict[str, str]:
    """Set the defaults of `CPU_ENVIRONMENT` that apply; returns what was set (nothing once torch is loaded)."""
    environ = os.environ if environ is None else environ
    if ("torch" in sys.modules) if torch_loaded is None else torch_loaded:
        return {}
    environ.update(chosen := cpu_environment_not_in_effect(environ))
    return chosen


def cpu_environment_not_in_effect(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The defaults of `CPU_ENVIRONMENT` that the environment neither sets nor overrides now (one set after torch
    loaded counts as present); empty with ``STAPO_TRL_CPU_ENVIRONMENT=0``."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "1") == "0":
        return {}
    return {
        name: value
        for name, value in CPU_ENVIRONMENT.items()
        if name not in environ and not any(other in environ for other in OVERRIDDEN_BY[name])
    }
