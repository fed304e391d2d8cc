"""`TrainScriptArguments`: what a recipe says beyond `STAPOConfig` and TRL's `ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data.arithmetic import ARITHMETIC, WORKED_EXAMPLES
from ..data.dapo_math import DAPO_MATH_HUB_ID
from ..data.prompts import PROMPT_STYLES
from ..methods import METHOD_NAMES
from ..rewards import available_rewards


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
