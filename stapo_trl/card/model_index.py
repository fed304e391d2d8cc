"""The results a model card states in its metadata, as ``model-index``, which the Hub renders on the model's page and
indexes: each one a `huggingface_hub.EvalResult`, written by `huggingface_hub.ModelCardData` (docs/diagnostics.md,
"The model card").

Two kinds of result go there: the held-out greedy accuracy `stapo-trl train` logs after training, and the avg@k of a
`stapo-trl eval` summary, one result per benchmark and sampling setting (the setting is the metric's ``config``).
Only avg@k measured on a whole benchmark from a Hub dataset goes there, complete: a result on the few problems shipped
with stapo-trl, on part of a benchmark, on a local file or with samples missing stays in the card's table alone, and
the card says so. The Hub reads ``dataset.type`` as a dataset id: for held-out problems of data without a Hub page
(stapo-trl's arithmetic generator, a local file), it is the name `stapo-trl train` was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult

from ..data.benchmarks import BENCHMARKS

TASK_TYPE = "text-generation"
TASK_NAME = "Text Generation"
GREEDY = "greedy"


@dataclass
class CardResults:
    """What the card's ``model-index`` holds, and the evaluation results left out of it, each with the reason."""

    eval_results: list[EvalResult] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def heldout_result(accuracy: dict[str, Any], dataset: str, title: str) -> EvalResult:
    """The held-out greedy accuracy after training (a `RunRecord`'s ``accuracy_after``) on problems held out of
    ``dataset`` (its Hub id, or the name the run was given), whose description is ``title``."""
    return EvalResult(
        task_type=TASK_TYPE,
        task_name=TASK_NAME,
        dataset_type=dataset,
        dataset_name=f"{title}: {accuracy['total']} problems held out from training",
        metric_type="accuracy",
        metric_name="held-out greedy accuracy",
        metric_value=round(float(accuracy["accuracy"]), 4),
        metric_config=GREEDY,
    )


def benchmark_results(summary: dict[str, Any], location: str) -> CardResults:
    """One result per benchmark and sampling setting of a `stapo-trl eval` summary (read from ``location``, for the
    reasons of what is left out) that was measured on a whole benchmark from a Hub dataset, with all its samples."""
    found = CardResults()
    datasets = summary.get("datasets") or {}
    for setting in summary.get("settings", []):
        for name, score in setting.get("benchmarks", {}).items():
            data = datasets.get(name) or {}
            title = BENCHMARKS[name].title if name in BENCHMARKS else name
            reason = _left_out_because(data, score)
            if reason is not None:
                found.left_out.append(f"{title} ({setting['label']}) in {location}: {reason}")
                continue
            k = score["samples_per_problem"]
            found.eval_results.append(
                EvalResult(
                    task_type=TASK_TYPE,
                    task_name=TASK_NAME,
                    dataset_type=data["source"],
                    dataset_name=title,
                    dataset_split=data.get("split"),
                    metric_type=f"avg@{k}",
                    metric_name=f"avg@{k} (%)",
                    metric_value=round(float(score["avg_at_k"]), 2),
                    metric_config=setting["label"],
                    metric_args={
                        "temperature": setting.get("temperature"),
                        "top_p": setting.get("top_p"),
                        "max_new_tokens": summary.get("max_new_tokens"),
                    },
                )
            )
    return found


def _left_out_because(data: dict[str, Any], score: dict[str, Any]) -> str | None:
    """Why a benchmark's avg@k stays out of ``model-index``, or None when it was measured on the whole benchmark from a
    Hub dataset, with every sample."""
    if not data:
        return "the summary does not record where its data came from"
    if data.get("source") == "sample":
        return "measured on the few problems shipped with stapo-trl"
    if not data.get("hub"):
        return f"measured on a local copy ({Path(str(data.get('source'))).name})"
    if score.get("partial"):
        return "measured on part of the benchmark"
    if not score.get("complete", True):
        return "samples are missing"
    return None


def card_results(
    accuracy_after: dict[str, Any] | None,
    heldout_dataset: tuple[str, str] | None,
    summaries: list[tuple[str, dict[str, Any]]],
) -> CardResults:
    """The card's results: the held-out accuracy (with ``heldout_dataset``, its id and description, when the run's
    data is known) and each summary's (``(location, summary)``, in the card's order). A result for the same data,
    metric and setting as an earlier one is left out."""
    results = CardResults()
    if accuracy_after and heldout_dataset is not None:
        results.eval_results.append(heldout_result(accuracy_after, *heldout_dataset))
    seen = set()
    for location, summary in summaries:
        found = benchmark_results(summary, location)
        results.left_out += found.left_out
        for result in found.eval_results:
            key = (result.unique_identifier, result.metric_type, result.metric_config)
            if key in seen:
                results.left_out.append(
                    f"{result.dataset_name} ({result.metric_config}) in {location}: an earlier summary has it"
                )
                continue
            seen.add(key)
            results.eval_results.append(result)
    return results
