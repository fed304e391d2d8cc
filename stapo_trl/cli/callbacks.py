"""Trainer callbacks of `stapo-trl train`: a JSON-lines metrics file, one summary line per logged step, and a Ctrl-C
that stops at a checkpoint."""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import ProgressCallback, TrainerCallback

from ..core.distributed import all_reduce_max, world_size
from ..diagnostics.run_record import step_line_parts
from ..storage import append_text, read_json_lines, write_text_atomically


class MetricsFileCallback(TrainerCallback):
    """Appends every log record of the main process, with its step and wall time, to ``path`` as it is logged (the
    log history of ``trainer_state.json``, live). A fresh run starts the file over; a resumed run first drops the
    records after its checkpoint and a line cut off mid-write, so that each step is there once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if state.global_step == 0:
                self.path.write_text("")
            elif self.path.is_file():
                kept = [record for record in read_json_lines(self.path) if record.get("step", 0) <= state.global_step]
                write_text_atomically(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch, "wall_seconds": time.perf_counter() - self.start}
        for key, value in logs.items():  # NaN and infinity as null: JSON has neither
            record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        append_text(self.path, json.dumps(record) + "\n")


def step_summary(logs: dict, step: int, max_steps: int) -> str:
    """One line for one logged training step: reward, entropy, what each token rule logged, length and loss."""

    def shown(*formats: tuple[str, str]) -> list[str]:
        return [pattern.format(logs[key]) for key, pattern in formats if key in logs]

    before = shown(("reward", "reward {:+.3f}"), ("entropy", "entropy {:.3f}"))
    after = shown(("completions/mean_length", "len {:.0f}"), ("loss", "loss {:+.4f}"))
    return " | ".join([f"step {step}/{max_steps}", *before, *step_line_parts(logs), *after])


class StepSummaryProgressCallback(ProgressCallback):
    """TRL's progress bar, with one readable line per logged step instead of the raw metrics dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "train_runtime" in logs:
            self.training_bar.write(
                f"trained {state.global_step} steps in {logs['train_runtime']:.0f} s "
                f"({logs['train_runtime'] / max(state.global_step, 1):.1f} s/step)"
            )
        elif "loss" in logs or "reward" in logs:  # not an evaluation record, such as the held-out accuracy
            self.training_bar.write(step_summary(logs, state.global_step, state.max_steps))


STOPPING_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
"""The signals that stop training at a checkpoint (Slurm, Kubernetes and spot preemption send SIGTERM first)."""
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal number, as a shell reports a killed process


class StopAtCheckpointOnSignal(TrainerCallback):
    """The first Ctrl-C or SIGTERM ends training after the current optimizer step with a checkpoint (even with
    ``save_strategy: "no"``); a second raises ``KeyboardInterrupt`` at once. With several processes, all stop after the
    same step, whichever was signalled. ``signal_received``: the signal that stopped training, or None."""

    def __init__(self) -> None:
        self.signal_received: int | None = None
        self._local_signal: int | None = None
        self._previous_handlers: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self._local_signal is not None:
            self.restore()
            raise KeyboardInterrupt
        self._local_signal = signum
        print(
            f"\n{STOPPING_SIGNALS.get(signum, signum)}: training stops after this optimizer step and saves a checkpoint "
            "to resume from. Send it again to stop at once, without one.",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPING_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        agreed = self._local_signal
        if world_size() > 1:
            agreed = int(all_reduce_max(torch.tensor([self._local_signal or 0]))[0]) or None
        if agreed is not None:
            self.signal_received = agreed
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()
