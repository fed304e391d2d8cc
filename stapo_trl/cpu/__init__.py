"""stapo-trl's CPU speed-ups, behind one entry: `cpu_runtime`. Names load on first access, so importing this package
(or `environment`) imports neither torch nor TRL."""

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
