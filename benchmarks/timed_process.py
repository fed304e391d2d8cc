"""One benchmark run in a process of its own, timed by the operating system: ``os.wait4`` gives the CPU time of the
process and of every process it waited for, and its peak resident memory."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TimedRun:
    output: str
    """What the process printed (stdout and stderr together)."""
    usage: os.struct_rusage  # type: ignore[name-defined]
    wall_seconds: float
    load_before: float
    load_after: float
    """The one-minute load average before the process started and after it ended."""


def run_timed(command: list[str], *, cwd: Path, env: dict[str, str]) -> TimedRun:
    """Run ``command`` to its end; a RuntimeError with the end of its output if it fails."""
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{output[-3000:]}")
    return TimedRun(output, usage, wall, load_before, os.getloadavg()[0])
