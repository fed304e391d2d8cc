"""The held-out greedy evaluation of `stapo-trl train`: logged before and after training as transformers names
evaluation metrics (the run's record reads them back from the log), and written problem by problem to
``heldout_results.jsonl`` for paired comparisons between runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from ..file_and_metric_names import HELDOUT_RESULTS_FILE
from ..run_record import HELDOUT_METRICS
from ..storage import write_text_atomically


def heldout_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The held-out greedy evaluation as transformers names evaluation metrics (``eval_*``, `HELDOUT_METRICS`), for the
    log history and the ``report_to`` trackers; the run's record reads them back."""
    return {metric: result[name] for name, metric in HELDOUT_METRICS.items() if result.get(name) is not None}


def log_metrics(trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the trainer's current step through transformers' `Trainer.log`: into the log history and
    the ``report_to`` trackers, without TRL's averaging of its own training metrics."""
    Trainer.log(trainer, dict(metrics))


def log_at_train_begin(trainer, metrics: dict[str, float]):
    """A callback that logs ``metrics`` at step 0 of a fresh run (a resumed run starts later and logs nothing)."""

    class LogAtTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                log_metrics(trainer, metrics)

    return LogAtTrainBegin()


def write_heldout_results(output_dir: Path, heldout, results: dict) -> Path:
    """``output_dir/heldout_results.jsonl``: each held-out problem with its greedy result before and after training,
    for paired comparisons between runs. Written whole to a temporary file, then renamed into place."""
    from ..evaluation.greedy import per_problem_records  # not at the top: `--dry_run` loads no evaluation package

    records = per_problem_records(heldout, results)
    return write_text_atomically(output_dir / HELDOUT_RESULTS_FILE, "".join(json.dumps(r) + "\n" for r in records))
