"""The per-sample results file: one JSON line per graded sample, appended as samples finish, so that a killed
evaluation resumes where it stopped. `<name>.settings.json` beside it records the settings that shape the samples;
resuming with other settings is refused."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..storage import DamagedFileError, append_text, read_json_file, write_text_atomically

logger = logging.getLogger(__name__)

SAMPLE_KEYS = ("benchmark", "problem_id", "sample")  # what identifies a sample; every record has them


class ResumeMismatchError(UsageError, ValueError):
    """The results file in the output directory was made with different settings."""


class SampleStore:
    """Append-only JSONL of graded samples, keyed by (benchmark, problem_id, sample)."""

    def __init__(self, path: str | os.PathLike, settings: Mapping[str, Any], *, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.settings_path = self.path.with_suffix(".settings.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        settings = json.loads(json.dumps(dict(settings), sort_keys=True))
        if overwrite:
            self.path.unlink(missing_ok=True)
            self.settings_path.unlink(missing_ok=True)
        if self.settings_path.is_file():
            remedy = "Pass --overwrite to discard the samples and start over, or use another output_dir."
            recorded = read_json_file(self.settings_path, "the settings of the samples beside it", remedy)
            changed = sorted(key for key in set(recorded) | set(settings) if recorded.get(key) != settings.get(key))
            if changed:
                details = "; ".join(f"{key}: {recorded.get(key)!r} then, {settings.get(key)!r} now" for key in changed)
                raise ResumeMismatchError(
                    f"{self.path} holds samples made with other settings ({details}). Use another output_dir, or "
                    "pass --overwrite to discard the old samples."
                )
        elif self.path.is_file() and self.path.stat().st_size:
            raise ResumeMismatchError(
                f"{self.path} exists but {self.settings_path.name} does not, so its settings are unknown. Use another "
                "output_dir, or pass --overwrite to discard it."
            )
        write_text_atomically(self.settings_path, json.dumps(settings, indent=2, sort_keys=True) + "\n")
        self.records: list[dict[str, Any]] = self._load()
        self._keys = {self.key(record) for record in self.records}

    @staticmethod
    def key(record: Mapping[str, Any]) -> tuple[str, str, int]:
        return (str(record["benchmark"]), str(record["problem_id"]), int(record["sample"]))

    def _load(self) -> list[dict[str, Any]]:
        """The finished records; a last line without its newline (a kill mid-write) is cut from the file."""
        if not self.path.is_file():
            return []
        complete, _, tail = self.path.read_bytes().rpartition(b"\n")
        if tail:
            logger.warning(
                "%s: dropping an unfinished last line (%d bytes) left by an interrupted run.", self.path, len(tail)
            )
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete) + 1 if complete else 0)
        records = []
        for number, line in enumerate(complete.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{self.path}, line {number}, is not valid JSON ({error}); the file is damaged."
                ) from error
        missing = [
            (number, sorted(set(SAMPLE_KEYS) - set(record)))
            for number, record in enumerate(records, start=1)
            if not isinstance(record, dict) or not set(SAMPLE_KEYS) <= set(record)
        ]
        if missing:
            number, keys = missing[0]
            raise DamagedFileError(
                f"{self.path}, record {number}, lacks {', '.join(keys)}: it is not a samples file written by stapo-trl "
                f"eval ({len(missing)} such records). Use another output_dir, or pass --overwrite to discard it."
            )
        unique: dict[tuple[str, str, int], dict[str, Any]] = {}
        for record in records:
            unique.setdefault(self.key(record), record)
        return list(unique.values())

    def __contains__(self, key: tuple[str, str, int]) -> bool:
        return key in self._keys

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        new = [dict(record) for record in records if self.key(record) not in self._keys]
        if not new:
            return
        append_text(self.path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in new))
        self.records.extend(new)
        self._keys.update(self.key(record) for record in new)

    def for_benchmark(self, benchmark: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record["benchmark"] == benchmark]
