"""One output directory, one run: the main process of `stapo-trl train` holds a lock on its output_dir while it runs;
a second run there is refused with the first one's PID, and a killed run leaves no stale lock."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from stapo_trl.cli.recipe import RecipeError
from stapo_trl.cli.train import LOCK_FILE, OutputDirLock


def test_a_second_run_on_a_held_output_dir_is_refused_with_the_first_ones_pid(tmp_path):
    first = OutputDirLock(tmp_path / "run")
    with pytest.raises(RecipeError, match=rf"is in use by another stapo-trl train \(PID {os.getpid()} on "):
        OutputDirLock(tmp_path / "run")
    first.release()
    OutputDirLock(tmp_path / "run").release()
    assert (tmp_path / "run" / LOCK_FILE).is_file()


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from stapo_trl.cli.train import OutputDirLock
                lock = OutputDirLock({str(tmp_path / "run")!r})
                print("locked", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=rf"PID {holder.pid} on"):
            OutputDirLock(tmp_path / "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    OutputDirLock(tmp_path / "run").release()  # the kernel released the dead process's lock


def test_an_output_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(RecipeError, match="is a file, not a directory"):
        OutputDirLock(tmp_path / "weights.bin")
