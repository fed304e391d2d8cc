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

from transformers import ProgressCallback, TrainerCallback

from .names import METRICS_FILE
from .token_rules import TOKEN_RULES


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFileCallback(TrainerCallback):
    """Appends every log record of the main process to `output_dir/metrics.jsonl`, with its step and wall time: the
    same records as the log history in ``trainer_state.json``, on disk as they are logged rather than only with a
    checkpoint or at the end.

    A fresh run (global step 0) starts the file over; a resumed run appends to it.
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.path is None:
            self.path = Path(args.output_dir) / METRICS_FILE
        self.start = time.perf_counter()
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if state.global_step == 0:
                self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or self.path is None:
            return
        record = {"step": state.global_step, "epoch": state.epoch, "wall_seconds": time.perf_counter() - self.start}
        record.update({key: _clean(value) for key, value in logs.items()})
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def step_summary(logs: dict, step: int, max_steps: int) -> str:
    """One line for one logged training step: reward, entropy, what each token rule logged (its spec's
    `step_line`), length and loss."""
    parts = [f"step {step}/{max_steps}"]
    if "reward" in logs:
        parts.append(f"reward {logs['reward']:+.3f}")
    if "entropy" in logs:
        parts.append(f"entropy {logs['entropy']:.3f}")
    for spec in sorted(TOKEN_RULES.values(), key=lambda spec: spec.order):
        parts += spec.step_line(logs)
    if "completions/mean_length" in logs:
        parts.append(f"len {logs['completions/mean_length']:.0f}")
    if "loss" in logs:
        parts.append(f"loss {logs['loss']:+.4f}")
    return " | ".join(parts)


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
            return
        if "loss" not in logs and "reward" not in logs:  # an evaluation record, such as the held-out accuracy
            return
        self.training_bar.write(step_summary(logs, state.global_step, state.max_steps))


class StopAtCheckpointOnInterrupt(TrainerCallback):
    """The first Ctrl-C (SIGINT) ends training after the current optimizer step, and the trainer saves a checkpoint
    the usual way (weights, optimizer, scheduler, RNG and STAPO's state), so that `resume_from_checkpoint: last`
    continues exactly there. A second Ctrl-C raises ``KeyboardInterrupt`` at once, without a checkpoint.

    Install it in a single-process run only, on the main thread: with several processes each would receive the signal
    at a different step. ``interrupted`` says whether training stopped this way.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._previous_handler = None

    def _handle(self, signum, frame) -> None:
        if self.interrupted:
            self.restore()
            raise KeyboardInterrupt
        self.interrupted = True
        print(
            "\nCtrl-C: training stops after this optimizer step and saves a checkpoint to resume from. "
            "Press Ctrl-C again to stop at once, without one.",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        """Put back the SIGINT handler that was there before training began (a no-op once done)."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGINT, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.interrupted:
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()
