"""The results of a model card's ``model-index`` metadata, as `huggingface_hub.EvalResult`s; which results go there:
docs/diagnostics.md, "The model card"."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult

from ..data.benchmarks import BENCHMARKS

TASK = {"task_type": "text-generation", "task_name": "Text Generation"}


@dataclass
class CardResults:
    """What the card's ``model-index`` holds, and the evaluation results left out of it, each with the reason."""

    eval_results: list[EvalResult] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def _left_out_because(data: dict[str, Any], score: dict[str, Any]) -> str | None:
    """Why a benchmark's avg@k stays out of ``model-index``, or None."""
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
    """The held-out accuracy (when ``heldout_dataset``, its data's id and description, is known) and the avg@k of each
    ``(location, summary)`` on a whole Hub benchmark with every sample; the others and repeats left out with why."""
    results = CardResults()
    if accuracy_after and heldout_dataset is not None:
        dataset, title = heldout_dataset
        results.eval_results.append(
            EvalResult(
                **TASK,
                dataset_type=dataset,
                dataset_name=f"{title}: {accuracy_after['total']} problems held out from training",
                metric_type="accuracy",
                metric_name="held-out greedy accuracy",
                metric_value=round(float(accuracy_after["accuracy"]), 4),
                metric_config="greedy",
            )
        )
    seen = set()
    for location, summary in summaries:
        datasets, repeated = summary.get("datasets") or {}, []
        for setting in summary.get("settings", []):
            for name, score in setting.get("benchmarks", {}).items():
                data, title = datasets.get(name) or {}, BENCHMARKS[name].title if name in BENCHMARKS else name
                where = f"{title} ({setting['label']}) in {location}"
                if (reason := _left_out_because(data, score)) is not None:
                    results.left_out.append(f"{where}: {reason}")
                    continue
                k = score["samples_per_problem"]
                sampling = {"temperature": setting.get("temperature"), "top_p": setting.get("top_p")}
                result = EvalResult(
                    **TASK,
                    dataset_type=data["source"],
                    dataset_name=title,
                    dataset_split=data.get("split"),
                    metric_type=f"avg@{k}",
                    metric_name=f"avg@{k} (%)",
                    metric_value=round(float(score["avg_at_k"]), 2),
                    metric_config=setting["label"],
                    metric_args={**sampling, "max_new_tokens": summary.get("max_new_tokens")},
                )
                if (key := (result.unique_identifier, result.metric_type, result.metric_config)) in seen:
                    repeated.append(f"{where}: an earlier summary has it")
                else:
                    seen.add(key)
                    results.eval_results.append(result)
        results.left_out += repeated
    return results
