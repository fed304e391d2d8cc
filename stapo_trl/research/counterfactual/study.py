"""`stapo-trl counterfactual RUN_DIR`: each saved generation's optimizer steps applied again from its saved state
under each arm, and the policy read teacher-forced after the first and the last step on the run's held-out prompts
(`measure`; docs/counterfactual.md describes the records)."""

from __future__ import annotations

import math
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from ...core.errors import UsageError
from ...core.names import ADVANTAGES_BEFORE_RULES_KEY, ENTROPIES_KEY, LOG_PROBS_KEY
from ...data.arithmetic import worked_answer, worked_solution
from ...data.prompts import answer_line
from ...file_and_metric_names import RECIPE_FILE
from ..generation_states import SavedGeneration, trainable_parameters
from ..gradient_probe import draw_seed, loss_tokens
from .arms import ARMS, NONE_ARM, StepTokens, arm_settings, select_tokens
from .replay import record_frozen_inputs, replay_step, restore_start, snapshot
from .teacher_forced import FrozenInputs, ProbeSequences, per_row_sums, probe_sequences, read_policy, sample_responses


class CounterfactualError(UsageError, ValueError):
    """A run directory or an option that `stapo-trl counterfactual` cannot work with; the message says why."""


@dataclass
class CounterfactualOptions:
    arms: tuple[str, ...] = tuple(ARMS)
    """The arms to run, put in `ARMS`'s order with ``none`` first, which always runs."""
    probe_problems: int = 32  # held-out problems in each probe set
    max_generations: int | None = None  # only the first this many saved generations
    seed: int = 0
    """Seeds the sampled responses (with the generation's index) and the random arm's draws."""
    share_quiet_steps: bool = True
    """Start each arm from ``none``'s state after the steps before its first silenced token (and take ``none``'s
    readouts there) instead of replaying them; False replays every step (the same records, slower)."""

    def __post_init__(self):
        if unknown := [arm for arm in self.arms if arm not in ARMS]:
            raise CounterfactualError(f"Unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}.")
        self.arms = tuple(arm for arm in ARMS if arm == NONE_ARM or arm in self.arms)


@dataclass
class ProbeSet:
    prompts: list[list[int]]
    references: ProbeSequences
    reference_frozen: FrozenInputs = field(default_factory=FrozenInputs)
    """The reference sequences' frozen-layer outputs, the same for every saved state: recorded once per run."""


def replay_provenance() -> dict[str, Any]:
    """What replayed a run, written into each record: the git commit (and uncommitted changes) of a checkout, the
    packages' versions, the CPU, torch's threads and CPU capability (bit-for-bit replays need the same kernels)."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    commit = dirty = None
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, check=True)
        dirty = bool(status.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    versions = {}
    for package in ("stapo-trl", "torch", "transformers", "trl", "peft", "accelerate"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "commit": commit,
        "uncommitted_changes": dirty,
        "packages": versions,
        "cpu": models[0] if models else platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def check_statistics_source(config, generations: list[SavedGeneration]) -> None:
    """Refuse a run with ``token_stats_source: loss`` whose generations feed several optimizer steps."""
    several = [g.generation for g in generations if g.optimizer_steps > 1]
    if several and getattr(config, "token_stats_source", "generation") == "loss":
        raise CounterfactualError(
            f"This run took p and H from the policy being optimized (token_stats_source: loss), and its generations "
            f"feed {max(g.optimizer_steps for g in generations)} optimizer steps each (generation {several[0]} "
            "first): after an arm's first silenced step, the saved statistics are no longer its policy's. Replay a "
            "run trained with token_stats_source: generation (the default), or with steps_per_generation equal to "
            "gradient_accumulation_steps."
        )


def recipe_arguments(run_dir: Path) -> list[str]:
    """The `stapo-trl train` arguments that made the run: its ``recipe.yaml`` and the flags of its first line."""
    recipe = run_dir / RECIPE_FILE
    if not recipe.is_file():
        raise CounterfactualError(f"{run_dir} has no {RECIPE_FILE}: it was not written by `stapo-trl train`.")
    first = recipe.read_text().splitlines()[0]
    tokens = shlex.split(first.lstrip("# "))[2:] if first.startswith("# stapo-trl train") else []
    flags, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token == "--config":
            skip = True
        elif not token.startswith("--config="):
            flags.append(token)
    return ["--config", str(recipe), *flags]


def reference_text(problem: str, answer: str, prompt_style: str) -> str:
    """The correct response to a held-out problem: for the built-in arithmetic problems the worked solution and the
    ``Answer:`` line, as the prompts' worked examples show them; otherwise the answer line alone."""
    worked = worked_solution(problem)
    if worked is not None and str(worked[1]) == answer:
        return worked_answer(worked[0], worked[1], prompt_style)
    return answer_line(answer, prompt_style)


def build_probe_set(tokenizer, heldout, count: int, prompt_style: str) -> ProbeSet:
    rows = heldout.select(range(min(count, len(heldout))))
    prompts, references = [], []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        response = reference_text(row["problem"], row["answer"], prompt_style)
        references.append(tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return ProbeSet(prompts, probe_sequences(prompts, references, pad))


@dataclass
class StateReadout:
    """The saved state's policy on the probe sets, which every arm is compared with."""

    sampled: ProbeSequences
    entropy: float
    reference_log_prob: float
    distributions: torch.Tensor
    sampled_frozen: FrozenInputs


def _reference_log_prob(model, probe: ProbeSet, temperature: float) -> float:
    """The mean over problems of the summed log-probability of each problem's reference response."""
    readout = read_policy(model, probe.references, temperature=temperature, frozen=probe.reference_frozen)
    per_problem = per_row_sums(readout.log_probs, readout.rows, len(probe.prompts)).tolist()
    return sum(per_problem) / len(per_problem)


def read_state(model, probe: ProbeSet, sampled: ProbeSequences, temperature: float) -> StateReadout:
    frozen = FrozenInputs()
    on_sampled = read_policy(model, sampled, temperature=temperature, keep_distributions=True, frozen=frozen)
    entropy = float(on_sampled.entropies.double().mean())
    reference = _reference_log_prob(model, probe, temperature)
    return StateReadout(sampled, entropy, reference, on_sampled.log_distributions, frozen)


def measure(model, probe: ProbeSet, state: StateReadout, start: dict[str, torch.Tensor], temperature: float) -> dict:
    """What the update from ``start`` to ``model``'s weights did, on the probe sets."""
    on_sampled = read_policy(
        model, state.sampled, temperature=temperature, reference=state.distributions, frozen=state.sampled_frozen
    )
    reference = _reference_log_prob(model, probe, temperature)
    now = trainable_parameters(model)
    update_sq = sum(float((now[name].double() - value.double()).square().sum()) for name, value in start.items())
    entropy = float(on_sampled.entropies.double().mean())
    return {
        "entropy": entropy,
        "entropy_change": entropy - state.entropy,
        "kl_from_state": float(on_sampled.kl_from.double().mean()),
        "reference_log_prob": reference,
        "reference_log_prob_change": reference - state.reference_log_prob,
        "update_norm": math.sqrt(update_sq),
    }


def step_tokens(batches: list[dict[str, Any]]) -> StepTokens:
    """A saved step's tokens as the token rules saw them, its micro-batches' rows concatenated."""
    return StepTokens(
        log_probs=torch.cat([batch[LOG_PROBS_KEY] for batch in batches]),
        entropies=torch.cat([batch[ENTROPIES_KEY] for batch in batches]),
        advantages=torch.cat([batch[ADVANTAGES_BEFORE_RULES_KEY] for batch in batches]),
        loss_mask=torch.cat([loss_tokens(batch) for batch in batches]),
    )


def _silenced_profile(tokens: StepTokens, silenced: torch.Tensor) -> dict[str, float | None]:
    found = bool(silenced.any())
    return {
        "log_prob_median": float(tokens.log_probs[silenced].median()) if found else None,
        "entropy_median": float(tokens.entropies[silenced].median()) if found else None,
    }


def arm_selections(generation: SavedGeneration, steps: list, args, options: CounterfactualOptions) -> dict:
    """Each arm's silenced tokens in each step of the generation."""
    selections = {arm: [] for arm in options.arms}
    for index, step in enumerate(steps):
        tokens = step_tokens(step.batches)
        for arm in options.arms:
            seed = draw_seed(options.seed, generation.generation, index, salt=list(ARMS).index(arm))
            settings = arm_settings(args, tokens, torch.Generator().manual_seed(seed))
            selections[arm].append(select_tokens(arm, tokens, settings))
    return selections


def run_generation(trainer, generation: SavedGeneration, probe: ProbeSet, options: CounterfactualOptions):
    """The records of one saved generation, one per arm."""
    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    start = generation.start()
    steps = [generation.step(index) for index in range(generation.optimizer_steps)]
    selections = arm_selections(generation, steps, args, options)
    base = {"generation": generation.generation, "first_global_step": generation.first_global_step}
    per_arm_counts = {arm: [int(mask.sum()) for mask in masks] for arm, masks in selections.items()}
    active = [arm for arm in options.arms if arm != NONE_ARM and any(per_arm_counts[arm])]
    restore_start(trainer, start)
    frozen_inputs = [record_frozen_inputs(trainer, step) for step in steps]
    state = None
    if active:
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        responses = sample_responses(
            model,
            probe.prompts,
            temperature=trainer.temperature,
            max_new_tokens=args.max_completion_length,
            seed=options.seed * 1_000_003 + generation.generation,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        state = read_state(model, probe, probe_sequences(probe.prompts, responses, pad), trainer.temperature)
    records, none_points, none_after, none_grad_norms = [], None, [], []
    for arm in options.arms:
        same_as_none = arm != NONE_ARM and arm not in active
        record = {**base, "arm": arm, "silenced_per_step": per_arm_counts[arm], "same_as_none": same_as_none}
        if same_as_none:
            records.append(record | {"points": none_points})
            continue
        first = 0
        if arm != NONE_ARM and options.share_quiet_steps:
            first = next(index for index, count in enumerate(per_arm_counts[arm]) if count)
        started = time.perf_counter()
        points, grad_norms, profiles, reproduction = {}, none_grad_norms[:first], [], []
        restore_start(trainer, none_after[first - 1] if first else start)
        if first and state is not None:
            points["first_step"] = none_points["first_step"]
        for index, step in enumerate(steps):
            silenced = selections[arm][index]
            profiles.append(_silenced_profile(step_tokens(step.batches), silenced))
            if index < first:
                continue
            grad_norms.append(replay_step(trainer, step, silenced, frozen_inputs[index]))
            if arm == NONE_ARM:
                now = trainable_parameters(model)
                reproduction.append(
                    max(float((now[name] - value).abs().max()) for name, value in step.trainable_after.items())
                )
                if options.share_quiet_steps and index < len(steps) - 1:
                    none_after.append(snapshot(trainer))
            point = "first_step" if index == 0 else "generation" if index == len(steps) - 1 else None
            if state is not None and point is not None:
                points[point] = measure(model, probe, state, start["trainable"], trainer.temperature)
            if state is not None and len(steps) == 1:
                points["generation"] = points["first_step"]
        record.update(
            points=points or None,
            grad_norms=grad_norms,
            silenced_profile=profiles,
            replayed_from_step=first,
            seconds=time.perf_counter() - started,
        )
        if arm == NONE_ARM:
            none_grad_norms, none_points = grad_norms, points or None
            record["reproduction_max_abs_difference"] = reproduction
            record["state"] = (
                None if state is None else {"entropy": state.entropy, "reference_log_prob": state.reference_log_prob}
            )
        records.append(record)
    return records
