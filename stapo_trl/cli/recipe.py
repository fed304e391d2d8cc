"""Reading a `stapo-trl train` recipe and flags (`TrainScriptArguments`, `STAPOConfig`, TRL's `ModelConfig`), checked
before anything is loaded. Precedence, lowest first: `STAPOConfig`'s defaults, the method's preset, the recipe's keys,
then flags; other keys are taken only as `accelerate launch` options (as in `trl grpo`) or `accelerate_config`."""

from __future__ import annotations

import argparse
import functools
import importlib.resources as resources
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..core.errors import UsageError
from ..data.arithmetic import ARITHMETIC, WORKED_EXAMPLES
from ..data.dapo_math import DAPO_MATH_HUB_ID
from ..data.prompts import PROMPT_STYLES
from ..methods import METHOD_NAMES, method_preset
from ..rewards import available_rewards
from .config_file import (
    ConfigFileKind,
    apply_config,
    parser_actions,
    read_config_file,
    read_config_flag,
    split_flags,
    suggest,
)
from .plan import BatchPlan, batch_plan

STALE_KEYS = {
    "max_prompt_length": "TRL 1.x removed it: GRPOTrainer no longer truncates prompts. Use max_prompt_tokens, which "
    "drops longer prompts when the data is loaded (verl's filter_overlong_prompts)",
    "torch_dtype": "TRL's ModelConfig calls it dtype now",
    "vllm_device": "TRL 1.x removed it. vllm_mode: colocate runs vLLM on every training GPU; for server mode, start "
    "`trl vllm-serve` on separate GPUs and set vllm_mode: server",
    "vllm_guided_decoding_regex": "TRL 1.x renamed it vllm_structured_outputs_regex",
    "wandb_log_unique_prompts": "TRL 1.x renamed it log_unique_prompts",
}
TRL_GRPO_REFUSED = {
    "dataset_test_split": "stapo-trl train runs no TRL evaluation loop. Hold problems out with heldout_problems "
    "(scored greedily before and after training), or score a checkpoint on the benchmarks with `stapo-trl eval`",
    "dataset_streaming": "stapo-trl train loads the dataset whole, to deduplicate DAPO-Math-17K and drop overlong "
    "prompts; streaming is not supported",
    "datasets": "stapo-trl train trains on one dataset, named by dataset_name; dataset mixtures are not supported",
}
"""`trl grpo` script arguments that `stapo-trl train` refuses, with the reason and what to use instead."""
ACCELERATE_CONFIG_KEY = "accelerate_config"


def _option(default, help: str, **metadata):
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class TrainScriptArguments:
    """Arguments of `stapo-trl train` that are not training or model arguments (docs/training.md)."""

    method: str = _option(
        "stapo",
        f"The method: {', '.join(METHOD_NAMES)}. Sets that method's defaults; keys in the recipe "
        "or on the command line override them.",
        choices=list(METHOD_NAMES),
    )
    dataset_name: str = _option(
        DAPO_MATH_HUB_ID,
        "DAPO-Math-17K as a Hub id or local path (verl or open-r1 schema), 'sample' for the rows shipped "
        "with stapo-trl, or 'arithmetic' for the built-in generator of arithmetic word problems.",
    )
    dataset_config: str | None = _option(None, "Hub config name of the dataset.")
    dataset_train_split: str = _option("train", "The split to train on.")
    prompt_style: str = _option(
        "boxed",
        "'boxed': answer in \\boxed{} (STAPO, JustRL). 'dapo': an 'Answer:' line (DAPO). A style "
        "paired with the other style's reward is refused.",
        choices=list(PROMPT_STYLES),
    )
    system_prompt: str | None = _option(None, "A system message put before every prompt.")
    dedupe: bool = _option(True, "Keep one row per problem (the Hub file of DAPO-Math-17K repeats each ~100 times).")
    max_prompt_tokens: int | None = _option(
        None,
        "Drop problems whose chat-formatted prompt is longer than this many tokens (verl's "
        "filter_overlong_prompts; TRL 1.x has no max_prompt_length).",
    )
    num_fewshot: int = _option(
        0,
        "For 'arithmetic': worked examples (0 to 3) put before each problem as earlier chat turns; they "
        "show the answer format, so the style's instruction wrapper is left out.",
    )
    num_train_problems: int | None = _option(
        None, "For 'arithmetic': how many problems to generate. Otherwise: train on a random subset of this size."
    )
    heldout_problems: int = _option(
        0,
        "Problems kept out of training and scored with greedy decoding (first reward function) before "
        "and after training. 0 turns this off.",
    )
    heldout_max_new_tokens: int | None = _option(
        None, "Token budget of the held-out greedy evaluation; defaults to max_completion_length."
    )
    lora_layers: int | None = _option(
        None,
        "With use_peft: put the LoRA adapters on the last this many transformer layers only (PEFT's "
        "layers_to_transform); the backward pass stops at the first adapted layer, which makes a step cheaper.",
    )
    cpu_lm_head: bool = _option(
        True,
        "On the CPU, run TRL's fused LM head with stapo-trl's CPU path (stapo_trl.cpu.lm_head: same results to float "
        "tolerance, a fraction of the time and memory); false keeps TRL's torch fallback.",
    )
    replay_frozen_layers: bool = _option(
        True,
        "On the CPU, let the loss pass reuse the frozen layers' hidden states from generate() (or from TRL's "
        "old-log-prob pass with colocated vLLM; same results up to float rounding); false runs every layer.",
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed"],
        metadata={
            "help": "Reward functions by registered name (dapo, boxed, math_verify, ...) or dotted import path."
        },
    )
    reward_model_name_or_path: str | None = _option(
        None,
        "A reward model (Hub id or local directory of a sequence-classification model), added after "
        "reward_funcs, as trl grpo does.",
    )
    dry_run: bool = _option(False, "Resolve the recipe, print the plan and exit without loading model or data.")
    overwrite_output_dir: bool = _option(
        False,
        "Start afresh in an output_dir that holds an earlier run: its checkpoints and run files are deleted first. "
        "Without it such an output_dir is refused, unless resume_from_checkpoint continues it.",
    )

    def __post_init__(self):
        for name in ("max_prompt_tokens", "num_train_problems", "lora_layers"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.num_fewshot:
            if not 0 < self.num_fewshot <= len(WORKED_EXAMPLES):
                raise ValueError(f"num_fewshot must be between 0 and {len(WORKED_EXAMPLES)}, got {self.num_fewshot}.")
            if self.dataset_name != ARITHMETIC:
                raise ValueError(
                    f"num_fewshot works with dataset_name: {ARITHMETIC} only (its worked examples are arithmetic "
                    f"problems); got dataset_name {self.dataset_name!r}. Remove num_fewshot, or put your own examples "
                    "in system_prompt."
                )
        if self.heldout_problems < 0:
            raise ValueError(f"heldout_problems must be 0 (off) or a positive count, got {self.heldout_problems}.")
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: name at least one reward function, for example [boxed].")
        asks = {"dapo": "an 'Answer:' line", "boxed": "the answer in \\boxed{}"}
        grader = {"dapo": "boxed", "boxed": "dapo"}.get(self.prompt_style)  # the other format's reward
        if grader in self.reward_funcs and self.prompt_style not in self.reward_funcs:
            raise ValueError(
                f"prompt_style {self.prompt_style!r} asks for {asks[self.prompt_style]}, but the reward {grader!r} "
                f"grades {asks[grader]}: a right answer in the asked format would score -1. Use reward_funcs: "
                f"[{self.prompt_style}], or prompt_style: {grader}."
            )
        known = available_rewards()
        for name in self.reward_funcs:
            if name not in known and "." not in name and ":" not in name:
                raise ValueError(
                    f"Unknown reward {name!r} in reward_funcs. Registered rewards: {', '.join(known)}. For your own "
                    "function, give its dotted import path, for example my_package.rewards.my_reward."
                )


class RecipeError(UsageError, ValueError):
    """A recipe or command line that cannot be run as written; the message says what to change."""


RECIPE = ConfigFileKind("stapo-trl train", "recipe", "for example one in recipes/quickstart/", RecipeError)


@dataclass
class TrainRequest:
    """Everything `stapo-trl train` resolved from a recipe and the command line, before loading anything."""

    script: TrainScriptArguments
    training: Any
    model: Any
    recipe_path: Path | None
    launch_args: list[str]
    cli_launch_tokens: list[str]
    world_size: int
    world_size_source: str
    plan: BatchPlan
    tools: tuple = ()
    """The settings of the tools attached as callbacks (`tool_arguments`, in that order)."""
    notes: list[str] = field(default_factory=list)
    cpu_stand_in: bool = False
    """A dry run without a GPU resolved a GPU recipe with `use_cpu=True`."""
    launch_environment: dict[str, str] = field(default_factory=dict)
    """Environment variables for the processes of `accelerate launch`."""
    argv: list[str] = field(default_factory=list)


def tool_arguments() -> tuple[type, ...]:
    """The settings dataclasses of the silenced-token dump, the gradient probe and the saved generation states."""
    from ..diagnostics.token_dump import TokenDumpArguments
    from ..research.generation_states import GenerationStatesArguments
    from ..research.gradient_probe import GradientProbeArguments

    return (TokenDumpArguments, GradientProbeArguments, GenerationStatesArguments)


def make_train_parser():
    from trl import ModelConfig, TrlParser

    from ..core.config import STAPOConfig

    return TrlParser((TrainScriptArguments, STAPOConfig, ModelConfig, *tool_arguments()), prog="stapo-trl train")


@functools.cache
def _launch_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def _option_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    options = [(option, action) for action in parser._actions for option in action.option_strings]
    return {option[2:]: action for option, action in options if option.startswith("--")}


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    return read_config_file(path, RECIPE)


def resolve_accelerate_config(name: str, recipe_path: Path | None) -> Path:
    """An accelerate config named in a recipe: a path (from the working directory or the recipe's), a name in an
    `accelerate/` directory beside the recipe or above it (`zero3`: `recipes/accelerate/zero3.yaml`), or the name of a
    config bundled with TRL (`zero1`, `zero2`, `zero3`, `fsdp1`, `fsdp2`, `multi_gpu`)."""
    candidates = [Path(name).expanduser()]
    if recipe_path is not None:
        recipe_dir = recipe_path.resolve().parent
        candidates.append(recipe_dir / name)
        stem = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
        candidates.extend(directory / "accelerate" / stem for directory in (recipe_dir, *recipe_dir.parents))
    for candidate in candidates:
        if candidate.is_file():
            resolved = candidate.resolve()
            return resolved.relative_to(Path.cwd()) if resolved.is_relative_to(Path.cwd()) else resolved
    bundled = resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")
    if bundled.is_file():
        return Path(str(bundled))
    raise RecipeError(
        f"accelerate_config {name!r} is neither a file nor a known config. Give a path to an accelerate config, or "
        "a name from recipes/accelerate/ (zero2, zero3, fsdp2) or from TRL (zero1, zero2, zero3, fsdp1, fsdp2, "
        "multi_gpu)."
    )


def _world_size(launch_args: list[str]) -> tuple[int, str]:
    if is_launched() and os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "from WORLD_SIZE of this launch"
    parsed, _ = _launch_parser().parse_known_args([*launch_args, "placeholder_script.py"])
    if parsed.num_processes is not None:
        return int(parsed.num_processes), "from num_processes"
    if parsed.config_file:
        config = yaml.safe_load(Path(parsed.config_file).read_text()) or {}
        if config.get("num_processes"):
            return int(config["num_processes"]), f"from num_processes in {parsed.config_file}"
    return 1, "one process: no --num_processes given"


LAUNCHER_CHOICES = ("--config_file", "--multi_gpu", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm", "--tpu")
"""Launch arguments that name `accelerate launch`'s launcher (an accelerate config names one too)."""


def cpu_multi_process_launch(launch_args: list[str], world_size: int, on_cpu: bool) -> tuple[list, dict[str, str]]:
    """The launch arguments and environment that start ``world_size`` processes on the CPU (accelerate without a
    launcher named starts one): ``--multi_gpu`` and ``ACCELERATE_USE_CPU=true`` (the processes join through gloo)."""
    if world_size <= 1 or not on_cpu or any(token.split("=", 1)[0] in LAUNCHER_CHOICES for token in launch_args):
        return launch_args, {}
    return [*launch_args, "--multi_gpu"], {"ACCELERATE_USE_CPU": "true"}


def is_launched() -> bool:
    """Whether this process was started by `accelerate launch`, `torchrun` or `stapo-trl train` itself."""
    return any(os.environ.get(name) for name in ("STAPO_TRL_LAUNCHED", "LOCAL_RANK", "WORLD_SIZE"))


CHECKPOINTING_NAMES = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}
"""transformers 5.24 renamed ``gradient_checkpointing*``; the recipes use the new names."""


def _spell_checkpointing_for_this_transformers(recipe: dict, cli_args: list[str], actions: dict) -> tuple[dict, list]:
    """``activation_checkpointing*`` written ``gradient_checkpointing*`` where ``actions`` lacks the new names."""
    missing = {new: old for new, old in CHECKPOINTING_NAMES.items() if new not in actions}
    if not missing:
        return recipe, cli_args
    recipe = {missing.get(key, key): value for key, value in recipe.items()}
    renamed = []
    for token in cli_args:
        name, sep, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        renamed.append(f"--{missing[name]}{sep}{value}" if name in missing else token)
    return recipe, renamed


def _refuse_stray_arguments(remaining: list[str], actions: dict, launch_options: dict[str, argparse.Action]) -> None:
    """Refuse a leftover token that is neither an `accelerate launch` option nor its value, unknown options first."""
    for token in remaining:
        name = token.lstrip("-").split("=", 1)[0]
        if token.startswith("-") and name != ACCELERATE_CONFIG_KEY and (name not in launch_options or name in actions):
            hint = STALE_KEYS.get(name) or TRL_GRPO_REFUSED.get(name)
            raise RecipeError(
                f"Unknown argument {token}." + (f" {hint}." if hint else suggest(name, [*actions, *launch_options]))
            )
    expects_value = False
    for token in remaining:
        if expects_value:
            expects_value = False
        elif token.startswith("-"):
            name = token.lstrip("-").split("=", 1)[0]
            action = launch_options.get(name)
            expects_value = "=" not in token and (name == ACCELERATE_CONFIG_KEY or getattr(action, "nargs", 0) != 0)
        else:
            raise RecipeError(
                f"unexpected argument {token!r}: stapo-trl train takes no positional arguments, only --key value "
                "options (recipe keys, or accelerate launch options); quote a value that holds spaces."
            )


def parse_train_args(argv: list[str]) -> TrainRequest:
    """Resolve `stapo-trl train [--config RECIPE] [--key value ...]` without loading a model or data."""
    recipe_path, recipe, cli_args = read_config_flag(argv, RECIPE)
    where = str(recipe_path) if recipe_path is not None else "command line"
    parser = make_train_parser()
    actions = parser_actions(parser)
    recipe, cli_args = _spell_checkpointing_for_this_transformers(recipe, cli_args, actions)
    launch_options = _option_names(_launch_parser())
    launch_actions = {name: action for name, action in launch_options.items() if name not in actions}
    if "method" in recipe:
        try:
            recipe["method"] = method_preset(recipe["method"]).name
        except ValueError as error:
            raise RecipeError(f"{where}: {error}") from None
    known, reasons = {*launch_actions, ACCELERATE_CONFIG_KEY}, {**STALE_KEYS, **TRL_GRPO_REFUSED}
    dataclass_values = apply_config(parser, recipe, where, RECIPE, known=known, reasons=reasons)
    launch_args: list[str] = []
    for key, value in recipe.items():
        if key == ACCELERATE_CONFIG_KEY:
            launch_args += ["--config_file", str(resolve_accelerate_config(str(value), recipe_path))]
        elif key in launch_actions and launch_actions[key].nargs == 0:
            launch_args += [f"--{key}"] if value else []
        elif key in launch_actions:
            launch_args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    method = split_flags(cli_args, ("--method",))[0].get("--method") or recipe.get("method", "stapo")
    try:
        preset = method_preset(method)
    except ValueError as error:
        raise RecipeError(str(error)) from None
    given_keys = set(recipe) | {token[2:].split("=", 1)[0] for token in cli_args if token.startswith("--")}
    notes = []
    dry_run = "--dry_run" in cli_args or bool(dataclass_values.get("dry_run"))
    wants_half = any(dataclass_values.get(key) or f"--{key}" in cli_args for key in ("bf16", "fp16"))
    cpu_stand_in = dry_run and wants_half and "use_cpu" not in given_keys and not torch.cuda.is_available()
    if cpu_stand_in:
        dataclass_values["use_cpu"] = True
        notes.append("no GPU here: the plan was resolved with use_cpu=true, so bf16 and devices were not checked")
    parser.set_defaults_with_config(**preset.defaults)
    parser.set_defaults_with_config(**dataclass_values)
    try:
        script, training, model, *tools, remaining = parser.parse_args_into_dataclasses(
            args=cli_args, return_remaining_strings=True
        )
    except RecipeError:
        raise
    except ValueError as error:
        raise RecipeError(f"{where}: {error}") from None
    _refuse_stray_arguments(remaining, actions, launch_options)
    if tools[0].dump_silenced_tokens:
        from ..diagnostics.token_dump import warn_if_nothing_to_record

        warn_if_nothing_to_record(training)
    cli_launch_tokens = list(remaining)
    if "--accelerate_config" in remaining:
        index = remaining.index("--accelerate_config")
        if index + 1 >= len(remaining):
            raise RecipeError("--accelerate_config needs a path or a config name, for example zero3.")
        config_file = resolve_accelerate_config(remaining[index + 1], recipe_path)
        remaining = [*remaining[:index], "--config_file", str(config_file), *remaining[index + 2 :]]
    launch_args += remaining
    if script.lora_layers is not None and not model.use_peft:
        raise RecipeError(
            f"{where}: lora_layers is set, but use_peft is false. Set use_peft: true, or remove lora_layers."
        )
    world_size, world_size_source = _world_size(launch_args)
    launch_environment = {}
    if not is_launched() and not cpu_stand_in:
        on_cpu = bool(training.use_cpu) or not torch.cuda.is_available()
        launch_args, launch_environment = cpu_multi_process_launch(launch_args, world_size, on_cpu)
        if launch_environment:
            notes.append(
                f"{world_size} processes on the CPU: accelerate's multi-process launcher (--multi_gpu, whatever the "
                "device), the processes joined through gloo"
            )
    try:
        plan = batch_plan(training, world_size, generation_batch_size_given="generation_batch_size" in given_keys)
    except ValueError as error:
        raise RecipeError(f"{where}: {error}") from None
    tensor_parallel = training.vllm_tensor_parallel_size
    if training.use_vllm and training.vllm_mode == "colocate" and world_size % tensor_parallel != 0:
        raise RecipeError(
            f"{where}: vllm_tensor_parallel_size ({tensor_parallel}) must divide the world size ({world_size}): in "
            "colocate mode each group of that many training processes shares one vLLM engine."
        )
    return TrainRequest(
        script=script,
        training=training,
        model=model,
        tools=tuple(tools),
        recipe_path=recipe_path,
        argv=list(argv),
        launch_args=launch_args,
        cli_launch_tokens=cli_launch_tokens,
        world_size=world_size,
        world_size_source=world_size_source,
        plan=plan,
        notes=notes,
        cpu_stand_in=cpu_stand_in,
        launch_environment=launch_environment,
    )
