"""Peak memory of a block of work on Linux: reset the process's peak RSS (VmHWM) through /proc/self/clear_refs, then
read how far it rose above the RSS held when it was reset."""

from __future__ import annotations


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB, for example ``VmRSS`` or ``VmHWM``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS and return that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_kib("VmRSS")


def peak_growth_mib(rss_at_reset_kib: int) -> float:
    """How far the peak RSS rose above ``rss_at_reset_kib`` (from `reset_peak_rss`), in MiB."""
    return (status_kib("VmHWM") - rss_at_reset_kib) / 1024
