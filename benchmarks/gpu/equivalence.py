"""Section 2: STAPO is GRPO when it silences nothing.

Four runs of the same steps from the same seeded weights and seed: GRPO, GRPO again, STAPO with the mask off, and
STAPO with ``prob_threshold`` 1e-30 (the mask on, its statistics computed, nothing silenced). On CUDA the runs use
``torch.use_deterministic_algorithms(True, warn_only=True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the ops that
still have no deterministic implementation are named from torch's warnings, and GRPO's second run measures the
run-to-run difference they leave. STAPO must then be bit-identical to GRPO, or, where GRPO is not even identical to
itself, no further from it than GRPO's second run; each STAPO run is then also compared with GRPO's second run (the
first H200 run found the three later runs alike and the first one apart). On the CPU every run must be
bit-identical.

The learning rate is large enough (the plan's) that the steps move the bf16 weights. The check runs one process
without DeepSpeed, so there are no fp32 master weights (the recipes' ZeRO stages keep them): one AdamW step at the
recipe's 1e-6 changes about 2% of bf16 weights of magnitude 0.02 and no norm weight (measured on the CPU), and
identical parameters would prove little.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import torch

from .models import ModelFactory, arithmetic_rows, build_tokenizer, vowel_share_reward
from .training import build_trainer, config_classes, free_memory, recipe_config, scratch_dir, stapo_settings, train

RUNS = (
    ("grpo", "grpo", None),
    ("grpo_repeat", "grpo", None),
    ("stapo_mask_off", "stapo", {"use_s2t_mask": False}),
    ("stapo_nothing_silenced", "stapo", {"prob_threshold": 1e-30}),
)
UNTIMED = ("time", "runtime", "per_second")


@contextmanager
def deterministic(device: str):
    """Deterministic algorithms on CUDA, yielding the list of warnings torch raises for ops that have none."""
    if device != "cuda":
        yield []
        return
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.use_deterministic_algorithms(previous)


def nondeterministic_ops(caught) -> list[str]:
    messages = {str(item.message).splitlines()[0][:200] for item in caught if "deterministic" in str(item.message)}
    return sorted(messages)


def parameter_difference(first: dict, second: dict) -> tuple[float, list[str]]:
    """(largest absolute difference over all parameters, names of the parameters that differ)."""
    largest, differing = 0.0, []
    for name, value in first.items():
        if not torch.equal(value, second[name]):
            differing.append(name)
            largest = max(largest, float((value.float() - second[name].float()).abs().max()))
    return largest, differing


def log_difference(first: list[dict], second: list[dict]) -> tuple[float, str | None]:
    """(largest absolute difference over the numbers both runs logged at each step, the first one that differs)."""
    if len(first) != len(second):
        return math.inf, f"{len(first)} against {len(second)} logged steps"
    largest, first_difference = 0.0, None
    for step, (a, b) in enumerate(zip(first, second, strict=True), 1):
        for key, value in a.items():
            if key not in b or any(word in key for word in UNTIMED) or not isinstance(value, (int, float)):
                continue
            other = b[key]
            if (value != value and other != other) or value == other:
                continue
            difference = abs(value - other) if math.isfinite(value) and math.isfinite(other) else math.inf
            largest = max(largest, difference)
            if first_difference is None:
                first_difference = f"step {step} {key}: {value!r} against {other!r}"
    return largest, first_difference


def moved_share(parameters: dict, initial: dict) -> float:
    changed = sum(int((value != initial[name].to(value.dtype)).sum()) for name, value in parameters.items())
    return changed / sum(value.numel() for value in parameters.values())


def run(section, plan, environment: dict) -> None:
    from datasets import Dataset

    tokenizer = build_tokenizer(plan.model.vocab_size)
    factory = ModelFactory(plan.model, tokenizer, device=section.device, dtype=torch.bfloat16)
    rows = arithmetic_rows(plan.run.num_prompts)
    dataset = Dataset.from_dict({"prompt": rows["prompt"], "solution": rows["solution"]})
    section.note("model", {"shape": plan.model.name, "parameters": factory.num_parameters, "dtype": "bf16"})
    section.note("steps", plan.equivalence_steps)
    section.note("learning_rate", plan.equivalence_learning_rate)

    results = {}
    estimate = 20.0
    with deterministic(section.device) as caught:
        for label, kind, stapo_overrides in RUNS:
            section.clock.require(estimate, f"the {label} run")
            extra = stapo_settings(plan, environment, **stapo_overrides) if kind == "stapo" else {}
            config = recipe_config(
                config_classes(kind),
                plan,
                scratch_dir(),
                max_steps=plan.equivalence_steps,
                learning_rate=plan.equivalence_learning_rate,
                **extra,
            )
            model = factory.build()
            trainer = build_trainer(kind, model, tokenizer, dataset, [vowel_share_reward], config)
            results[label] = train(trainer, label, section.clock, section.device, keep_parameters=True)
            del trainer, model
            free_memory()
            if results[label].cut_short:
                section.skip("STAPO against GRPO", f"the {label} run was stopped at the section's deadline")
                return
            estimate = 1.5 * results[label].wall_seconds + 5
    report(section, results, factory.weights, nondeterministic_ops(caught))


def report(section, results: dict, initial: dict, flagged: list[str]) -> None:
    grpo = results["grpo"]
    moved = moved_share(grpo.parameters, initial)
    section.record(
        "share of weights the GRPO steps changed", moved, "", "> 0, else identical weights prove nothing", moved > 0
    )
    if section.on_cuda:
        section.record(
            "ops without a deterministic implementation",
            len(flagged),
            "",
            "",
            None,
            "; ".join(flagged) or "none flagged",
        )
    floor_parameters, _ = parameter_difference(grpo.parameters, results["grpo_repeat"].parameters)
    floor_logs, floor_first = log_difference(grpo.logs, results["grpo_repeat"].logs)
    if section.on_cuda:
        section.record("GRPO against GRPO: largest parameter difference", floor_parameters, "", "", None)
        section.record("GRPO against GRPO: largest logged difference", floor_logs, "", "", None, floor_first or "")
    else:
        section.record(
            "GRPO against GRPO: largest parameter difference", floor_parameters, "", "0", floor_parameters == 0
        )
        section.record(
            "GRPO against GRPO: largest logged difference", floor_logs, "", "0", floor_logs == 0, floor_first or ""
        )

    nothing = results["stapo_nothing_silenced"].logs
    candidates = sum(entry.get("s2t/num_candidates", math.nan) for entry in nothing)
    silenced = sum(entry.get("s2t/num_silenced", math.nan) for entry in nothing)
    section.record(
        "threshold 1e-30: candidates and silenced tokens, all steps",
        f"{candidates:g} candidates, {silenced:g} silenced",
        "",
        "0 and 0 (the mask ran and silenced nothing)",
        candidates == 0 and silenced == 0,
    )
    for label in ("stapo_mask_off", "stapo_nothing_silenced"):
        difference, differing = parameter_difference(grpo.parameters, results[label].parameters)
        logged, first = log_difference(grpo.logs, results[label].logs)
        for quantity, value, floor, detail in (
            ("parameter", difference, floor_parameters, f"{len(differing)} tensors differ" if differing else ""),
            ("logged", logged, floor_logs, first or ""),
        ):
            if floor == 0:
                target, passed = "0 (bit-identical)", value == 0
            else:
                target, passed = f"<= GRPO's own run-to-run difference {floor:.3g}", value <= floor
            section.record(f"{label} against GRPO: largest {quantity} difference", value, "", target, passed, detail)
        if floor_parameters or floor_logs:
            difference, differing = parameter_difference(results["grpo_repeat"].parameters, results[label].parameters)
            logged, first = log_difference(results["grpo_repeat"].logs, results[label].logs)
            section.record(
                f"{label} against GRPO's second run: largest parameter and logged difference",
                f"{difference:.4g} and {logged:.4g}",
                "",
                "",
                None,
                "; ".join(filter(None, [f"{len(differing)} tensors differ" if differing else "", first or ""]))
                or "bit-identical to GRPO's second run",
            )
