"""DAPO-Math-17K for TRL: schema detection, problem-level dedupe, and the `dapo` or `boxed` prompt."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset

from .prompts import build_prompt, check_prompt_style, extract_problem
from .sources import ROW_FEATURES, DatasetSchemaError, dataset_row, gold_text, load_source

logger = logging.getLogger(__name__)

DAPO_MATH_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
OPEN_R1_HUB_ID = "open-r1/DAPO-Math-17k-Processed"

_VERL_SCHEMA = "verl schema (prompt: list of chat messages, reward_model.ground_truth, data_source, extra_info.index)"
_OPEN_R1_SCHEMA = "open-r1 processed schema (prompt: str, solution: str)"


@dataclass(frozen=True)
class DedupReport:
    """What deduplication did to a DAPO-Math-17K source."""

    rows_before: int
    rows_after: int
    rows_without_answer: int = 0
    conflicting_problems: int = 0
    rows_without_problem: int = 0

    @property
    def duplicate_rows(self) -> int:
        return self.rows_before - self.rows_without_answer - self.rows_without_problem - self.rows_after

    def __str__(self) -> str:
        text = (
            f"{self.rows_before:,} rows -> {self.rows_after:,} unique problems "
            f"({self.duplicate_rows:,} duplicate rows removed"
        )
        if self.rows_without_answer:
            text += f", {self.rows_without_answer:,} rows without a gold answer dropped"
        if self.rows_without_problem:
            text += f", {self.rows_without_problem:,} rows with an empty prompt dropped"
        if self.conflicting_problems:
            text += f"; {self.conflicting_problems:,} problems had conflicting gold answers, the first was kept"
        return text + ")"


def _detect_schema(dataset: Dataset, label: str) -> str:
    if len(dataset) == 0:
        raise DatasetSchemaError(f"{label} has no rows.")
    columns = dataset.column_names
    prompt = dataset[0].get("prompt")
    if "prompt" in columns and "reward_model" in columns and isinstance(prompt, list):
        return "verl"
    if "prompt" in columns and "solution" in columns and isinstance(prompt, str):
        return "open-r1"
    found = f"{columns} with prompt of type {type(prompt).__name__}" if "prompt" in columns else str(columns)
    raise DatasetSchemaError(
        f"{label} matches no known DAPO-Math-17K schema. Expected the {_VERL_SCHEMA} or the {_OPEN_R1_SCHEMA}; "
        f"found fields {found}."
    )


def _user_text(messages: Any, row: int, label: str) -> str:
    """The last user message of a verl row's ``prompt`` ("" for an empty one); another shape is refused."""
    if messages is None or (isinstance(messages, list) and not messages):
        return ""
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        raise DatasetSchemaError(
            f"{label}, row {row} (counting from 0): prompt is {_kind(messages)}; in the {_VERL_SCHEMA} it is a list of "
            "{role, content} messages."
        )
    if any("role" not in message and {"from", "value"} <= set(message) for message in messages):
        raise DatasetSchemaError(
            f"{label}, row {row} (counting from 0): the prompt's messages use ShareGPT's {{from, value}} keys. Convert "
            "them to {role, content} (from: human -> role: user, from: gpt -> role: assistant, value -> content) first."
        )
    users = [message for message in messages if message.get("role") == "user"]
    content = (users or messages)[-1].get("content")
    if content is not None and not isinstance(content, str):
        raise DatasetSchemaError(
            f"{label}, row {row} (counting from 0): the user message's content is {_kind(content)}, not text."
        )
    return content or ""


def _kind(value: Any) -> str:
    """``a list ([1, 2])``: the type and the start of the repr, for error messages."""
    text, name = repr(value), type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({text[:40] + '...' if len(text) > 40 else text})"


def _normalize_rows(
    batch: dict[str, list], indices: list[int], *, schema: str, style: str, system_prompt: str | None, label: str
):
    rows = []
    for offset, index in enumerate(indices):
        if schema == "verl":
            original = _user_text(batch["prompt"][offset], index, label)
            reward_model = batch["reward_model"][offset] or {}
            gold = gold_text(reward_model.get("ground_truth"))
        else:
            original = batch["prompt"][offset] or ""
            if not isinstance(original, str):
                raise DatasetSchemaError(
                    f"{label}, row {index} (counting from 0): prompt is {_kind(original)}; in the {_OPEN_R1_SCHEMA} it "
                    "is text."
                )
            gold = gold_text(batch["solution"][offset])
        extra_info = batch["extra_info"][offset] if "extra_info" in batch else None
        row_id = extra_info.get("index") if isinstance(extra_info, dict) else None
        problem = extract_problem(original)
        prompt = build_prompt(problem, style, system_prompt, original=original)
        source = (batch["data_source"][offset] if "data_source" in batch else None) or "math_dapo"
        rows.append(dataset_row(str(index if row_id is None else row_id), problem, gold, prompt, source))
    return {name: [row[name] for row in rows] for name in ROW_FEATURES}


def dedupe_by_problem(dataset: Dataset, *, dedupe: bool = True) -> tuple[Dataset, DedupReport]:
    """Keep the first row of each problem (whitespace-insensitive; every row with `dedupe=False`) and drop rows
    without a gold answer or with an empty problem. A problem seen with different gold answers keeps its first and is
    counted in the report."""
    problems, answers = list(dataset["problem"]), list(dataset["answer"])
    first_row: dict[str, int] = {}
    keep: list[int] = []
    conflicts: set[str] = set()
    without_answer = without_problem = 0
    for row, (problem, answer) in enumerate(zip(problems, answers, strict=True)):
        if answer is None:
            without_answer += 1
            continue
        if not problem.strip():
            without_problem += 1
            continue
        key = " ".join(problem.split())
        seen = first_row.get(key)
        if seen is None or not dedupe:
            first_row.setdefault(key, row)
            keep.append(row)
        elif answers[seen] != answer:
            conflicts.add(key)
    return dataset.select(keep), DedupReport(len(dataset), len(keep), without_answer, len(conflicts), without_problem)


def load_dapo_math(
    source: str | Path = DAPO_MATH_HUB_ID,
    *,
    split: str = "train",
    config_name: str | None = None,
    prompt_style: str = "dapo",
    system_prompt: str | None = None,
    dedupe: bool = True,
    num_proc: int | None = None,
    return_report: bool = False,
) -> Dataset | tuple[Dataset, DedupReport]:
    """DAPO-Math-17K as TRL-ready rows (`ROW_FEATURES`). `source` is `BytedTsinghua-SIA/DAPO-Math-17k` (default),
    `open-r1/DAPO-Math-17k-Processed` (`config_name` "all" by default, or "en", "cn"), a local parquet, jsonl or json
    file or dataset directory in either schema, or `"sample"` for the shipped copy (duplicates included). The `dapo`
    `prompt_style` keeps the dataset's "Answer: $Answer" instruction; `boxed` asks for `\\boxed{}` after the bare
    problem. `dedupe` keeps one row per problem; the counts are logged, and returned as a `DedupReport` with
    `return_report`. `num_proc` processes convert the rows."""
    check_prompt_style(prompt_style)
    if config_name is None and str(source) == OPEN_R1_HUB_ID:
        config_name = "all"
    label = f"DAPO-Math-17K source {str(source)!r}"
    raw = load_source(source, split=split, label=label, config_name=config_name, sample="dapo_math_17k")
    schema = _detect_schema(raw, label)
    dataset = raw.map(
        _normalize_rows,
        batched=True,
        with_indices=True,
        remove_columns=raw.column_names,
        features=ROW_FEATURES,
        fn_kwargs={"schema": schema, "style": prompt_style, "system_prompt": system_prompt, "label": label},
        num_proc=num_proc,
        desc="Formatting DAPO-Math-17K",
    )
    dataset, report = dedupe_by_problem(dataset, dedupe=dedupe)
    logger.info("%s: %s", label, report)
    if len(dataset) == 0:
        answer_field = "reward_model.ground_truth" if schema == "verl" else "solution"
        raise DatasetSchemaError(
            f"{label}: none of its {report.rows_before:,} rows has both a problem and a gold answer "
            f"({report.rows_without_answer:,} rows have no {answer_field}, {report.rows_without_problem:,} an empty "
            "prompt)."
        )
    if report.conflicting_problems:
        logger.warning(
            f"{label}: {report.conflicting_problems} problems appear with different gold answers; the first answer of "
            "each was kept."
        )
    return (dataset, report) if return_report else dataset
