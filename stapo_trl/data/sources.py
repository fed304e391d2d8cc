"""Loading a dataset from the Hub, from a local file or directory, or from the samples shipped with stapo-trl."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, List, Value, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from ..core.errors import UsageError

logger = logging.getLogger(__name__)

SAMPLES_DIR = Path(__file__).with_name("samples")
SAMPLE = "sample"  # `source="sample"` loads the small sample shipped with stapo-trl instead of the Hub dataset

ROW_FEATURES = Features(
    {name: Value("string") for name in ("id", "problem", "answer", "solution")}
    | {"prompt": List({"content": Value("string"), "role": Value("string")}), "data_source": Value("string")}
)
"""The columns every stapo-trl loader returns; `solution` repeats `answer` because TRL rewards read `solution`."""


def dataset_row(row_id: str, problem: str, answer: str | None, prompt: list[dict], data_source: str) -> dict:
    """One row in the `ROW_FEATURES` columns, `solution` repeating `answer`."""
    return dict(id=row_id, problem=problem, answer=answer, solution=answer, prompt=prompt, data_source=data_source)


def gold_text(gold: Any) -> str | None:
    """A gold answer as text, the form every loader stores and every reward compares against: integral floats lose
    their ".0" (AMC), lists are joined with ", " (OlympiadBench), and empty or NaN values give None (TRL skips them)."""
    if gold is None:
        return None
    if isinstance(gold, float):
        return None if not math.isfinite(gold) else str(int(gold)) if gold.is_integer() else repr(gold)
    if isinstance(gold, (list, tuple)):
        return ", ".join(part for part in map(gold_text, gold) if part) or None
    return str(gold).strip() or None


_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


class DatasetSchemaError(UsageError, ValueError):
    """A dataset lacks the fields a loader needs."""


def sample_path(name: str) -> Path:
    """Path of a shipped sample file, for example `sample_path("dapo_math_17k")`."""
    path = SAMPLES_DIR / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in SAMPLES_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"No shipped sample named {name!r}; the samples are {known}.")
    return path


def load_source(
    source: str | Path, *, split: str, label: str, config_name: str | None = None, sample: str | None = None
) -> Dataset:
    """One split of `source`: a Hub id, a local parquet/jsonl/json/csv/arrow file (read by `load_dataset`), a directory
    written by `save_to_disk`, a directory of data files, or `"sample"` for the shipped sample named `sample`."""
    if str(source) == SAMPLE:
        if sample is None:
            raise ValueError(f"{label} has no shipped sample.")
        source = sample_path(sample)
    path = Path(source).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DatasetSchemaError(f"{label}: cannot read {path}; use a {', '.join(sorted(_FILE_BUILDERS))} file.")
        if path.stat().st_size == 0:
            raise DatasetSchemaError(f"{label}: {path} is empty.")
        try:
            return load_dataset(builder, data_files={split: str(path)}, split=split)
        except DatasetGenerationError as error:
            raise DatasetSchemaError(f"{label}: cannot read {path} as {builder}: {error.__cause__ or error}") from None
        except ValueError as error:
            if "corresponds to no data" not in str(error):
                raise
            raise DatasetSchemaError(f"{label}: {path} has no rows.") from None
    if path.is_dir():
        saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
        loaded = load_from_disk(str(path)) if saved else load_dataset(str(path), name=config_name)
        if isinstance(loaded, Dataset):
            return loaded
        if split not in loaded and len(loaded) == 1:
            logger.info("%s: the local data has only the split %r; using it for %r.", label, next(iter(loaded)), split)
            split = next(iter(loaded))
        if split not in loaded:
            raise DatasetSchemaError(
                f"{label}: no split {split!r}; the data has splits {sorted(loaded)}. Pass split=... to choose."
            )
        return loaded[split]
    if str(source).startswith((".", "/", "~")) or path.suffix.lower() in _FILE_BUILDERS:
        raise FileNotFoundError(f"{label}: no such file or directory: {path}")
    return load_dataset(str(source), name=config_name, split=split)
