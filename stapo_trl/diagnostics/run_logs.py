"""What `stapo-trl report` reads of a run directory: its log (which one: docs/diagnostics.md), dump and record."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..core.names import TRAINER_STATE_FILE
from ..core.resume import last_complete_checkpoint
from ..file_and_metric_names import METRICS_FILE
from ..storage import read_json_lines
from .run_record import RunRecord, build_run_record, is_training_record
from .token_dump import read_dump


class ReportError(UsageError, ValueError):
    """A run directory that cannot be reported on, with what is missing and how to get it."""


@dataclass
class RunLogs:
    """What one run directory holds for the report."""

    label: str
    directory: Path
    history: list[dict[str, Any]]
    """The log's training steps (`read_history`), which the figures draw."""
    source: Path
    record: RunRecord
    """The run's facts, built from the whole log and the dump, which the tables and text show."""
    silenced_tokens: list[dict[str, Any]] | None = None
    dump_stats: dict[str, Any] | None = None


def find_log_source(directory: Path) -> Path | None:
    """The run's log: its ``trainer_state.json``, the newest checkpoint's, or ``metrics.jsonl``; None if none is."""
    if (own := directory / TRAINER_STATE_FILE).is_file():
        return own
    if (checkpoint := last_complete_checkpoint(directory)) is not None:
        return checkpoint / TRAINER_STATE_FILE
    return metrics if (metrics := directory / METRICS_FILE).is_file() else None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file but its final summary (and a last line cut off mid-write)."""
    return [record for record in read_json_lines(path) if "train_runtime" not in record]


def read_log(source: Path) -> list[dict[str, Any]]:
    """Every record of a ``trainer_state.json``'s log history or of a ``metrics.jsonl``."""
    try:
        is_metrics = source.name == METRICS_FILE
        return read_json_lines(source) if is_metrics else json.loads(source.read_text()).get("log_history", [])
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise ReportError(
            f"{source} cannot be read ({error}); the file is damaged. Point the report at a checkpoint-N/ of the run, "
            "whose trainer_state.json holds the log up to that step."
        ) from None


def _steps(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in log if "step" in record and is_training_record(record)]


def read_history(source: Path) -> list[dict[str, Any]]:
    """The training steps of a ``trainer_state.json`` or ``metrics.jsonl`` (`is_training_record`)."""
    return _steps(read_log(source))


def load_run(directory: str | Path, label: str | None = None) -> RunLogs:
    """Read one run directory, or raise :class:`ReportError` saying what is missing (a damaged dump file raises
    `stapo_trl.storage.DamagedFileError`, naming it)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory}: no such directory.")
    if (source := find_log_source(directory)) is None:
        raise ReportError(
            f"{directory}: no training log found. The report reads {TRAINER_STATE_FILE} (written at the end of "
            f"`stapo-trl train`, by `trainer.save_state()`, and in every checkpoint-N/) or {METRICS_FILE} (written "
            "by `stapo-trl train`). Point it at a training output_dir, or call trainer.save_state() after "
            "trainer.train() in your own script."
        )
    log = read_log(source)
    if not (history := _steps(log)):
        raise ReportError(
            f"{source}: the log holds no training steps. Was the run stopped before its first logging step "
            "(logging_steps)?"
        )
    silenced_tokens, dump_stats = read_dump(directory)
    record = build_run_record(log, silenced_tokens=silenced_tokens, dump_stats=dump_stats)
    return RunLogs(label or directory.resolve().name, directory, history, source, record, silenced_tokens, dump_stats)
