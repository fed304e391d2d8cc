"""The drop-in matrix: STAPOTrainer beside GRPOTrainer under each family of GRPOConfig options and trainer arguments.

For every family, three runs of a tiny Qwen3 (2 optimizer steps) make three checks:

- **equal to GRPO**: `STAPOTrainer` with the mask off (`use_s2t_mask=False`) and `GRPOTrainer` with the same options
  log the same numbers and end with bit-identical parameters. GRPO gets STAPO's one differing default,
  `epsilon_high=0.28` (DAPO's clip-higher), so that both run the same config;
- **trains**: `STAPOTrainer` with the mask on changes every trainable parameter and logs TRL's loss and the S2T metrics
  at every step;
- **masks**: in that run, the step pools hold candidates (low-probability tokens of positive-advantage completions)
  and S2T silences some of them. The tiny model spreads probability over about 50 tokens, so `prob_threshold` is
  raised to 0.05 to make candidates common.

The table in docs/records/drop-in-matrix.md lists these families; the refusals that remain are tested at the end.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset, IterableDataset
from peft import LoraConfig, PromptTuningConfig
from tiny import (
    build_char_tokenizer,
    count_vowels_chat_reward,
    count_vowels_reward,
    prompt_dataset,
    save_tiny_chat_model,
    save_tiny_tool_model,
    tiny_config,
)
from transformers import (
    AutoTokenizer,
    Qwen3Config,
    Qwen3ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    set_seed,
)
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.config import LOSS_TYPES

MASK_ON = {"prob_threshold": 0.05}
GRPO_SIDE = {"epsilon_high": 0.28}
"""STAPOConfig's only default that differs from GRPOConfig's (checked by the first test)."""
TIMING_WORDS = ("time", "runtime", "per_second")


# --- models ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = AutoTokenizer.from_pretrained(save_tiny_chat_model(root / "dense")).chat_template

    set_seed(0)
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )
    torch.nn.init.normal_(moe.lm_head.weight, std=0.5)
    moe.save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")

    scorer = Qwen3ForSequenceClassification(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.nn.init.normal_(scorer.score.weight, std=1.0)
    scorer.save_pretrained(root / "reward-model")
    tokenizer.save_pretrained(root / "reward-model")

    return {
        "dense": root / "dense",
        "moe": root / "moe",
        "reward": root / "reward-model",
        "tool": save_tiny_tool_model(root / "tool"),
    }


# --- rewards, datasets and tools -----------------------------------------------------------------------------------


def count_consonants_reward(completions, **kwargs) -> list[float]:
    return [sum(character in "bcdfgh" for character in completion) / 4.0 for completion in completions]


async def async_count_vowels_reward(completions, **kwargs) -> list[float]:
    await asyncio.sleep(0)
    return count_vowels_reward(completions)


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


class CounterEnvironment:
    def reset(self, **kwargs):
        self.count = 0

    def increment(self, step: int) -> int:
        """
        Add to the counter.

        Args:
            step: The amount to add.

        Returns:
            The counter.
        """
        self.count += step
        return self.count


class CountdownEnvironment(CounterEnvironment):
    """Owns its data: ``reset`` returns the prompt, so the dataset row only names the environment."""

    def reset(self, **kwargs):
        super().reset()
        return "Count to three with the counter."


class EchoEnvironment:
    def reset(self, **kwargs):
        return "Say the word louder."

    def shout(self, text: str) -> str:
        """
        Repeat a word louder.

        Args:
            text: The word.

        Returns:
            The word in capitals.
        """
        return text.upper()


def conversational_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+{i + 1}="}] for i in range(8)]})


def iterable_dataset() -> IterableDataset:
    rows = prompt_dataset().to_list()
    return IterableDataset.from_generator(lambda: iter(rows))


# --- the families ----------------------------------------------------------------------------------------------------


@dataclass
class Family:
    """One option family: config values, trainer arguments built fresh for each run, and the model to train."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    trainer_kwargs: Callable[[dict[str, Path]], dict[str, Any]] = lambda models: {}
    model: str = "dense"
    fake_completions: Callable[[AutoTokenizer], Callable] | None = None
    """Replaces `model.generate` (as TRL's own tool tests do): a random tiny model never writes a tool call."""
    mask_on: dict[str, Any] = field(default_factory=dict)
    """Extra values for the mask-on run only, where the family's model gives too few candidates at the default."""
    shows_the_option_ran: Callable[[Any], bool] | None = None
    """Evidence in the mask-on run that the option did something, where the run's metrics show it."""


def tool_call_completions(call: str) -> Callable:
    """Replaces `generate`: first-turn rows get, in turn, a valid call, a call with a wrong argument name and plain
    text; rows that already hold a tool response get 'done'."""
    wrong_call = call.replace('"b"', '"c"').replace('"step"', '"size"')
    first_turn = [f"<tool_call>\n{call}\n</tool_call>", f"<tool_call>\n{wrong_call}\n</tool_call>", "no tool here"]

    def build(tokenizer):
        def encode(text):
            return tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)

        tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")

        def generate(input_ids, **kwargs):
            rows = [
                encode("done") if (prompt == tool_response).any() else encode(first_turn[index % 3])
                for index, prompt in enumerate(input_ids)
            ]
            width = max(map(len, rows))
            padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
            return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=-1)

        return generate

    return build


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def two_of_three_called_a_tool_and_one_call_failed(trainer) -> bool:
    return logged(trainer, "tools/call_frequency")[-1] == pytest.approx(2 / 3) and logged(
        trainer, "tools/failure_frequency"
    )[-1] == pytest.approx(1 / 2)


def random_rollout(prompts, trainer) -> dict[str, list]:
    """A custom `rollout_func`: one completion per prompt it is given, token ids drawn from a generator seeded by the
    step, so every run gets the same completions."""
    tokenizer = trainer.processing_class
    generator = torch.Generator().manual_seed(trainer.state.global_step)
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        length = int(torch.randint(2, trainer.max_completion_length + 1, (1,), generator=generator))
        prompt_ids.append(tokenizer.encode(prompt, add_special_tokens=False))
        completion_ids.append(torch.randint(3, len(tokenizer), (length,), generator=generator).tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


FAMILIES = [
    *[Family(f"loss_type={loss}", {"loss_type": loss}) for loss in LOSS_TYPES],
    Family(
        "KL penalty (beta>0) with sync_ref_model", {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1}
    ),
    Family("KL penalty without bias correction", {"beta": 0.1, "use_bias_correction_kl": False}),
    Family(
        "num_iterations>1 with gradient accumulation",
        {"num_iterations": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
    ),
    Family(
        "steps_per_generation != gradient_accumulation_steps",
        {"steps_per_generation": 4, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
    ),
    Family(
        "sequence-level importance sampling, off-policy mask",
        {"importance_sampling_level": "sequence", "off_policy_mask_threshold": 0.5, "num_iterations": 2},
    ),
    Family(
        "reward scaling and sampling options",
        {"scale_rewards": "batch", "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1},
    ),
    Family("entropy bonus", {"entropy_coef": 0.01}),
    Family(
        "multiple weighted rewards, one async, normalized then summed",
        {"reward_weights": [1.0, 0.5], "multi_objective_aggregation": "normalize_then_sum"},
        lambda models: {"reward_funcs": [count_consonants_reward, async_count_vowels_reward]},
    ),
    Family(
        "reward model",
        {},
        lambda models: {"reward_funcs": [str(models["reward"]), count_vowels_reward]},
        shows_the_option_ran=lambda trainer: any(
            key.startswith("rewards/reward-model") for entry in trainer.state.log_history for key in entry
        ),
    ),
    Family(
        "conversational dataset",
        {},
        lambda models: {"train_dataset": conversational_dataset(), "reward_funcs": count_vowels_chat_reward},
    ),
    Family(
        "transformers continuous batching",
        {
            "use_transformers_continuous_batching": True,
            # Unbounded, the KV cache takes 90% of free memory.
            "transformers_continuous_batching_config": {"num_blocks": 8, "page_size": 32, "max_batch_tokens": 256},
        },
    ),
    Family("custom rollout_func", {}, lambda models: {"rollout_func": random_rollout}),
    Family("iterable dataset", {}, lambda models: {"train_dataset": iterable_dataset()}),
    Family(
        "eval dataset",
        {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 8},
        lambda models: {"eval_dataset": prompt_dataset(4)},
        shows_the_option_ran=lambda trainer: len(logged(trainer, "eval_reward")) == 2,
    ),
    Family("LoRA", {}, lambda models: {"peft_config": lora()}),
    Family(
        "prompt tuning (PEFT prompt learning)",
        {},
        lambda models: {"peft_config": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)},
    ),
    Family("gradient checkpointing", {"gradient_checkpointing": True}, lambda models: {"peft_config": lora()}),
    Family("cast_lm_head_to_fp32", {"cast_lm_head_to_fp32": True}),
    Family(
        "mixture-of-experts model",
        {},
        model="moe",
        mask_on={"prob_threshold": 0.1},
        shows_the_option_ran=lambda trainer: len(logged(trainer, "aux_loss")) == 2,
    ),
    Family("mask_truncated_completions", {"mask_truncated_completions": True, "max_completion_length": 24}),
    Family(
        "tool calling",
        {"per_device_train_batch_size": 6, "num_generations": 3, "max_completion_length": 96},
        lambda models: {
            "tools": [multiply],
            "train_dataset": conversational_dataset(),
            "reward_funcs": count_vowels_chat_reward,
        },
        model="tool",
        fake_completions=tool_call_completions('{"name": "multiply", "arguments": {"a": 3, "b": 4}}'),
        shows_the_option_ran=two_of_three_called_a_tool_and_one_call_failed,
    ),
    Family(
        "environment factory",
        {"per_device_train_batch_size": 6, "num_generations": 3, "max_completion_length": 96},
        lambda models: {
            "environment_factory": CounterEnvironment,
            "train_dataset": conversational_dataset(),
            "reward_funcs": count_vowels_chat_reward,
        },
        model="tool",
        fake_completions=tool_call_completions('{"name": "increment", "arguments": {"step": 1}}'),
        shows_the_option_ran=two_of_three_called_a_tool_and_one_call_failed,
    ),
    Family(
        "environment-owned data (rows name one of several environments, reset() gives the prompt)",
        {"per_device_train_batch_size": 6, "num_generations": 3, "max_completion_length": 96},
        lambda models: {
            "environment_factory": {"countdown": CountdownEnvironment, "echo": EchoEnvironment},
            "train_dataset": Dataset.from_dict({"environment": ["countdown", "echo"] * 4}),
            "reward_funcs": count_vowels_chat_reward,
        },
        model="tool",
        fake_completions=tool_call_completions('{"name": "increment", "arguments": {"step": 1}}'),
        shows_the_option_ran=lambda trainer: len(logged(trainer, "tools/call_frequency")) == trainer.args.max_steps,
    ),
]


def train(trainer_class, config_class, family: Family, models, output_dir, **overrides):
    config = tiny_config(config_class, output_dir, **{**family.config, **overrides})
    kwargs = {"reward_funcs": count_vowels_reward, "train_dataset": prompt_dataset(), **family.trainer_kwargs(models)}
    trainer = trainer_class(model=str(models[family.model]), args=config, **kwargs)
    trainer.initial_parameters = {
        name: value.detach().clone() for name, value in trainer.model.named_parameters() if value.requires_grad
    }
    if family.fake_completions is None:
        trainer.train()
    else:
        generate = family.fake_completions(trainer.processing_class)
        with patch.object(trainer.model, "generate", side_effect=generate):
            trainer.train()
    return trainer


def step_logs(trainer) -> list[dict[str, float]]:
    """Every logged entry, without wall-clock timings."""
    return [
        {key: value for key, value in entry.items() if not any(word in key for word in TIMING_WORDS)}
        for entry in trainer.state.log_history
    ]


def test_stapo_config_differs_from_grpo_config_only_in_epsilon_high(tmp_path):
    grpo = tiny_config(GRPOConfig, tmp_path).to_dict()
    stapo = tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False).to_dict()
    differing = {name: (grpo[name], stapo[name]) for name in grpo if grpo[name] != stapo[name]}
    assert differing == {"epsilon_high": (None, GRPO_SIDE["epsilon_high"])}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_family(family, models, tmp_path):
    grpo = train(GRPOTrainer, GRPOConfig, family, models, tmp_path / "grpo", **GRPO_SIDE)
    off = train(STAPOTrainer, STAPOConfig, family, models, tmp_path / "off", use_s2t_mask=False)
    on = train(STAPOTrainer, STAPOConfig, family, models, tmp_path / "on", **{**MASK_ON, **family.mask_on})

    # equal to GRPO
    assert step_logs(off) == step_logs(grpo)
    for (name, left), (_, right) in zip(grpo.model.named_parameters(), off.model.named_parameters(), strict=True):
        assert torch.equal(left, right), name

    # trains
    unchanged = [
        name for name, before in on.initial_parameters.items() if torch.equal(before, on.model.get_parameter(name))
    ]
    assert not unchanged, f"trainable parameters that did not change: {unchanged}"
    steps = [entry for entry in on.state.log_history if "loss" in entry]
    assert len(steps) == on.args.max_steps
    assert all(math.isfinite(entry["loss"]) and "s2t/silenced_fraction" in entry for entry in steps)
    if family.shows_the_option_ran is not None:
        assert family.shows_the_option_ran(on), on.state.log_history

    # masks
    candidates = sum(entry["s2t/num_candidates"] for entry in steps)
    silenced = sum(entry["s2t/num_silenced"] for entry in steps)
    assert candidates >= 2, "the family's runs produced too few candidates to test the mask"
    assert 0 < silenced <= candidates


def assert_equal_to_grpo(family: Family, models, root: Path) -> None:
    grpo = train(GRPOTrainer, GRPOConfig, family, models, root / "grpo", **GRPO_SIDE)
    off = train(STAPOTrainer, STAPOConfig, family, models, root / "off", use_s2t_mask=False)
    assert step_logs(off) == step_logs(grpo)
    for (name, left), (_, right) in zip(grpo.model.named_parameters(), off.model.named_parameters(), strict=True):
        assert torch.equal(left, right), name


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        (
            Family(
                "steps_per_generation not a multiple of gradient_accumulation_steps",
                {"steps_per_generation": 4, "gradient_accumulation_steps": 3, "per_device_train_batch_size": 2},
            ),
            r"steps_per_generation \(4\) must be a multiple of gradient_accumulation_steps \(3\)",
        ),
        (
            Family("20-Entropy (top_entropy_quantile < 1)", {"top_entropy_quantile": 0.2}),
            r"use_s2t_mask=True conflicts with top_entropy_quantile=0.2",
        ),
    ],
    ids=lambda value: value.name if isinstance(value, Family) else "",
)
def test_deliberate_refusals_run_like_grpo_with_the_mask_off(family, refusal, models, tmp_path):
    """The two settings STAPOConfig refuses with the mask on (docs/reliability.md says why) still run as GRPO does
    with the mask off."""
    assert_equal_to_grpo(family, models, tmp_path)
    with pytest.raises(ValueError, match=refusal):
        tiny_config(STAPOConfig, tmp_path / "on", **family.config, **MASK_ON)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the run trains; this pins the CPU behaviour")
def test_use_liger_kernel_is_passed_through_as_in_trl(tmp_path):
    """TRL 1.16 accepts the deprecated flag and patches the model's layers with Liger's Triton kernels when training
    starts; on a CPU, Triton then stops at the first forward. STAPO behaves the same, with the same error. Not run on
    a GPU. The runs happen in a child process (liger_worker.py) because Liger patches the transformers modules
    themselves, which would give every later test's Qwen3 Triton kernels."""
    worker = Path(__file__).with_name("liger_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes["grpo"] is not None, "GRPOTrainer trained with Liger's kernels on a CPU"
    assert outcomes["stapo"] == outcomes["grpo"]
    assert "active drivers" in outcomes["grpo"][1] or "liger" in outcomes["grpo"][1].lower(), outcomes["grpo"]
