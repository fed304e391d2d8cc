"""Section 4: what STAPO costs over GRPO, in time per optimizer step and in peak device memory.

Each run is one generation cycle of the scaled recipe (4 optimizer steps, one generation of 32 completions, TRL's
old-log-prob pass, and for STAPO the statistics pass of each later step, as ``token_stats_source: loss`` asks), from
the same seeded weights and seed. A warm-up run of each method comes first (kernel compilation, allocator); then pairs
alternate which method goes first (GRPO-STAPO, STAPO-GRPO, ...), so that drift of the machine falls on both. The time
of a run is the sum of its optimizer steps, each measured between CUDA synchronisations; the ratio is the median over
pairs of STAPO's time over GRPO's. Memory is ``torch.cuda.max_memory_allocated`` over each run, reset before it.

A random model never samples EOS, so every completion runs to ``max_completion_length`` in both methods: both
generate the same number of tokens, and the learning rate is the recipe's 1e-6.
"""

from __future__ import annotations

import statistics

import torch

from .models import ModelFactory, arithmetic_rows, build_tokenizer, vowel_share_reward
from .training import build_trainer, config_classes, free_memory, recipe_config, scratch_dir, stapo_settings, train

TIME_TARGET = 1.02
MEMORY_TARGET = 1.01


def runner(shape):
    def run_shape(section, plan, environment):
        return run(section, plan, environment, shape)

    return run_shape


def schedule(repeats: int) -> list[tuple[str, str]]:
    runs = [("grpo", "warm-up"), ("stapo", "warm-up")]
    for pair in range(repeats):
        order = ("grpo", "stapo") if pair % 2 == 0 else ("stapo", "grpo")
        runs += [(kind, f"pair {pair + 1}") for kind in order]
    return runs


def one_run(section, plan, environment, factory, tokenizer, dataset, kind: str):
    extra = stapo_settings(plan, environment) if kind == "stapo" else {}
    config = recipe_config(
        config_classes(kind),
        plan,
        scratch_dir(),
        max_steps=plan.run.steps_per_cycle,
        learning_rate=plan.recipe_learning_rate,
        **extra,
    )
    model = factory.build()
    trainer = build_trainer(kind, model, tokenizer, dataset, [vowel_share_reward], config)
    result = train(trainer, kind, section.clock, section.device)
    del trainer, model
    free_memory()
    return result


def measure(section, plan, environment: dict, shape) -> dict:
    from datasets import Dataset

    tokenizer = build_tokenizer(shape.vocab_size)
    factory = ModelFactory(shape, tokenizer, device=section.device, dtype=torch.bfloat16)
    rows = arithmetic_rows(plan.run.num_prompts)
    dataset = Dataset.from_dict({"prompt": rows["prompt"], "solution": rows["solution"]})
    section.note("model", {"shape": shape.name, "parameters": factory.num_parameters, "dtype": "bf16"})
    section.note("run", {"optimizer steps": plan.run.steps_per_cycle, **vars(plan.run)})

    runs: dict[str, list] = {"grpo": [], "stapo": []}
    estimate = 30.0
    stopped = None
    for kind, role in schedule(plan.cost_repeats):
        if section.clock.left() < estimate:
            stopped = f"the {kind} run of {role} needs about {estimate:.0f} s; {section.clock.left():.0f} s were left"
            break
        result = one_run(section, plan, environment, factory, tokenizer, dataset, kind)
        if result.cut_short:
            stopped = f"the {kind} run of {role} was stopped at the section's deadline"
            break
        peak = f", peak {result.peak_bytes / 2**30:.2f} GiB" if result.peak_bytes is not None else ""
        section.report.say(
            f"[{section.name}] {kind} {role}: {result.seconds:.2f} s for {len(result.step_seconds)} steps{peak}"
        )
        if role != "warm-up":
            runs[kind].append(result)
        estimate = 1.3 * result.wall_seconds + 10
    return {"runs": runs, "stopped": stopped}


def run(section, plan, environment: dict, shape) -> None:
    measured = measure(section, plan, environment, shape)
    runs, stopped = measured["runs"], measured["stopped"]
    pairs = list(zip(runs["grpo"], runs["stapo"], strict=False))
    steps = plan.run.steps_per_cycle
    for kind in ("grpo", "stapo"):
        if runs[kind]:
            seconds = statistics.median(result.seconds for result in runs[kind]) / steps
            section.record(
                f"{kind} time per optimizer step", round(seconds, 4), "s", "", None, f"{len(runs[kind])} runs"
            )
    lengths = {kind: [r.logs[0].get("completions/mean_length") for r in runs[kind]] for kind in runs}
    section.note("completion mean length of each run's generation", lengths)
    enough = len(pairs) >= plan.cost_repeats
    reason = stopped or ""
    if not pairs:
        section.skip("STAPO/GRPO time per optimizer step", reason or "no pair of runs completed")
        return
    ratios = [stapo.seconds / grpo.seconds for grpo, stapo in pairs]
    record_ratio(
        section,
        "STAPO/GRPO time per optimizer step",
        statistics.median(ratios),
        TIME_TARGET,
        f"median of {len(pairs)} alternated pairs, each {min(ratios):.3f} to {max(ratios):.3f}",
        enough,
        reason,
    )
    if section.on_cuda:
        memory = max(r.peak_bytes for r in runs["stapo"]) / max(r.peak_bytes for r in runs["grpo"])
        record_ratio(
            section,
            "STAPO/GRPO peak GPU memory",
            memory,
            MEMORY_TARGET,
            f"largest peak of each: {max(r.peak_bytes for r in runs['stapo']) / 2**30:.2f} against "
            f"{max(r.peak_bytes for r in runs['grpo']) / 2**30:.2f} GiB",
            enough,
            reason,
        )
    else:
        section.record(
            "STAPO/GRPO peak GPU memory",
            None,
            "",
            "",
            None,
            "not measured on the CPU (torch.cuda.max_memory_allocated only)",
            status="not_measured",
        )


def record_ratio(section, name: str, value: float, target: float, note: str, enough: bool, reason: str) -> None:
    if not enough:
        section.record(
            name, round(value, 4), "", f"<= {target}", None, f"{note}; too few pairs: {reason}", status="skipped"
        )
    elif not section.on_cuda:
        section.record(
            name,
            round(value, 4),
            "",
            f"<= {target} on the GPU shapes",
            None,
            f"{note}; toy sizes on the CPU, where STAPO's fixed work per step is not amortised",
            status="not_applicable",
        )
    else:
        section.record(name, round(value, 4), "", f"<= {target}", value <= target, note)
