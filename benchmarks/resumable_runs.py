"""One `stapo-trl train` run carried to its end across interruptions (or skipped once finished), for the benchmarks
that train many runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from provenance import REPO


def step_lines(line: str) -> bool:
    return line.startswith("step ")


def run_to_the_end(
    command: list[str],
    output_dir: Path,
    threads: int | None = None,
    echo: Callable[[str], bool] = step_lines,
    max_steps: int | None = None,
) -> Path:
    """Run ``command`` (a `stapo-trl train` command line writing to ``output_dir``, which must checkpoint) unless the
    run has finished (its ``run_summary.json`` exists: skipped), resumed from the newest complete checkpoint in
    ``output_dir``, or started again when the run stopped before its first. With ``max_steps``, a finished run of
    another length raises SystemExit. Prints the run's output lines that ``echo`` selects as they come, and the time
    taken; raises with the end of its stderr when it fails. ``threads`` caps torch's CPU threads (OMP_NUM_THREADS)."""
    if (output_dir / "run_summary.json").is_file():
        if max_steps is not None:
            trained = json.loads((output_dir / "trainer_state.json").read_text())["max_steps"]
            if trained != max_steps:
                raise SystemExit(
                    f"{output_dir} is a finished {trained}-step run, not {max_steps}: pass a new --runs_dir"
                )
        print(f"  {output_dir.name}: done already, skipped", flush=True)
        return output_dir
    sys.path.insert(0, str(REPO))
    from stapo_trl.core.resume import last_complete_checkpoint

    command = list(command)
    checkpoint = last_complete_checkpoint(output_dir) if output_dir.is_dir() else None
    if checkpoint is not None:
        print(f"  {output_dir.name}: resuming from {checkpoint.name}", flush=True)
        command += ["--resume_from_checkpoint", "last"]
    elif output_dir.is_dir():
        print(f"  {output_dir.name}: stopped before its first checkpoint, starting it again", flush=True)
        command += ["--overwrite_output_dir", "true"]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the step lines arrive as they are printed
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True, env=environment
        )
        for line in process.stdout:
            if echo(line):
                print(f"  {output_dir.name}: {line.rstrip()}", flush=True)
        errors.seek(0)
        stderr = errors.read()
    if process.wait() != 0:
        raise RuntimeError(f"{output_dir.name} failed:\n{stderr[-3000:]}")
    print(f"  {output_dir.name}: finished in {time.perf_counter() - started:.0f} s", flush=True)
    return output_dir
