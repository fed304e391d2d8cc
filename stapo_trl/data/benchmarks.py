"""The six evaluation benchmarks of the STAPO paper, each normalized to `id`, `problem`, `answer`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset

from .prompts import build_prompt, check_prompt_style
from .sources import ROW_FEATURES, DatasetSchemaError, dataset_row, gold_text, load_source


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a benchmark lives on the Hub, its other names, and which of its fields (tried in order, so that mirrors
    load too) hold the problem, answer and id. `samples_per_problem` is the N of the paper's avg@N (32 for AIME and
    AMC, 4 for the rest)."""

    name: str
    title: str
    hub_id: str
    split: str
    aliases: tuple[str, ...]
    samples_per_problem: int = 4
    problem_fields: tuple[str, ...] = ("problem",)
    answer_fields: tuple[str, ...] = ("answer",)
    id_fields: tuple[str, ...] = ("id",)
    context_fields: tuple[str, ...] = ()


_QUESTION = ("question", "problem")
_SPECS = (
    BenchmarkSpec("aime24", "AIME 2024", "HuggingFaceH4/aime_2024", "train", ("aime2024", "aime_2024"), 32),
    BenchmarkSpec("aime25", "AIME 2025", "math-ai/aime25", "test", ("aime2025", "aime_2025"), 32),
    BenchmarkSpec("amc23", "AMC 2023", "math-ai/amc23", "test", ("amc", "amc2023"), 32, _QUESTION),
    BenchmarkSpec(
        "math500",
        "MATH-500",
        "HuggingFaceH4/MATH-500",
        "test",
        ("math-500", "math_500"),
        id_fields=("unique_id", "id"),
    ),
    BenchmarkSpec(
        "minerva", "Minerva Math", "math-ai/minervamath", "test", ("minervamath", "minerva_math"), 4, _QUESTION
    ),
    BenchmarkSpec(
        "olympiadbench",
        "OlympiadBench",
        "math-ai/olympiadbench",
        "test",
        ("olympiad", "olympiad_bench"),
        4,
        _QUESTION,
        answer_fields=("final_answer", "answer"),
        context_fields=("context",),
    ),
)
BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in _SPECS}

_ALIASES = {alias: name for name, spec in BENCHMARKS.items() for alias in (name, *spec.aliases)}
_INLINE_MATH = re.compile(r"^\$+([^$]*)\$+$")
_INTEGER = re.compile(r"^[+-]?\d+$")


def benchmark_spec(name: str) -> BenchmarkSpec:
    """The spec for a benchmark name or alias (case-insensitive)."""
    key = _ALIASES.get(name.lower().strip())
    if key is None:
        raise ValueError(f"Unknown benchmark {name!r}; choose one of {sorted(BENCHMARKS)}.")
    return BENCHMARKS[key]


def benchmark_answer(value: Any) -> str | None:
    """A gold answer as the rewards expect it: `$...$` removed, integers without leading zeros ("033" -> "33"),
    integral floats without ".0" (27.0 -> "27"), and lists (OlympiadBench) joined with ", "."""
    if isinstance(value, (list, tuple)):
        return gold_text([benchmark_answer(part) for part in value])
    text = gold_text(value) or ""
    match = _INLINE_MATH.match(text)  # gold_text's text is stripped already
    text = match.group(1).strip() if match else text
    return (str(int(text)) if _INTEGER.match(text) else text) or None


def load_benchmark(
    name: str,
    source: str | Path | None = None,
    *,
    split: str | None = None,
    config_name: str | None = None,
    prompt_style: str = "boxed",
    system_prompt: str | None = None,
) -> Dataset:
    """One of aime24, aime25, amc23, math500, minerva, olympiadbench as rows `id`, `problem`, `answer`, `solution`
    (the gold answer again, for the rewards), a conversational `prompt`, and `data_source`. `source` overrides the Hub
    id: another Hub id (for example `yentinglin/aime_2025` with `split="train"`), a local file or dataset directory, or
    `"sample"` for the few original problems shipped with stapo-trl. A row without a usable answer is an error."""
    spec = benchmark_spec(name)
    check_prompt_style(prompt_style)
    source = spec.hub_id if source is None else source
    label = f"{spec.title} source {str(source)!r}"
    raw = load_source(source, split=split or spec.split, label=label, config_name=config_name, sample=spec.name)
    columns = raw.column_names

    def field(candidates: tuple[str, ...], what: str | None = None) -> str | None:
        found = next((name for name in candidates if name in columns), None)
        if found is None and what:
            raise DatasetSchemaError(
                f"{label} has no {what} field. Expected one of {list(candidates)} (and {what} fields of {spec.hub_id}); "
                f"found {columns}."
            )
        return found

    problem_field, answer_field = field(spec.problem_fields, "problem"), field(spec.answer_fields, "answer")
    id_field, context_field = field(spec.id_fields), field(spec.context_fields)

    def normalize(row: dict, index: int) -> dict:
        problem = (row[problem_field] or "").strip()
        context = (row[context_field] or "").strip() if context_field else ""
        if context:
            problem = f"{context}\n\n{problem}"
        answer = benchmark_answer(row[answer_field])
        if answer is None:
            raise DatasetSchemaError(
                f"{label}: row {index} has no usable answer in {answer_field!r}: {row[answer_field]!r}."
            )
        row_id = row[id_field] if id_field else None
        row_id = str(row_id) if row_id is not None else f"{spec.name}-{index}"
        return dataset_row(row_id, problem, answer, build_prompt(problem, prompt_style, system_prompt), spec.name)

    return raw.map(
        normalize, with_indices=True, remove_columns=columns, features=ROW_FEATURES, desc=f"Formatting {spec.title}"
    )
