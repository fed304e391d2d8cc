"""STAPO with TRL's KL penalty (beta > 0): TRL computes reference log-probs through the same method STAPO extends, and
STAPO takes its statistics only from the policy's own passes, never from the reference model's."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from tiny import count_vowels_reward, prompt_dataset, tiny_config
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer


def train(trainer_class, config_class, model_dir, output_dir, peft=False, **overrides):
    config = tiny_config(config_class, output_dir, beta=0.1, max_steps=3, **overrides)
    trainer = trainer_class(
        model=str(model_dir),
        reward_funcs=count_vowels_reward,
        args=config,
        train_dataset=prompt_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
    )
    trainer.train()
    return trainer


def logged(trainer, key):
    return [record[key] for record in trainer.state.log_history if key in record]


@pytest.mark.parametrize(
    "case",
    [
        {"name": "reference model", "overrides": {}},
        {"name": "reference model, TRL's old-log-prob pass", "overrides": {"num_iterations": 2}},
        {"name": "LoRA: adapters off for the reference", "peft": True, "overrides": {}},
        {"name": "LoRA with TRL's old-log-prob pass", "peft": True, "overrides": {"num_iterations": 2}},
        {"name": "sync_ref_model", "overrides": {"sync_ref_model": True, "ref_model_sync_steps": 1}},
        {"name": "no KL bias correction", "overrides": {"use_bias_correction_kl": False}},
    ],
    ids=lambda case: case["name"],
)
def test_stapo_trains_with_a_kl_penalty_and_takes_statistics_from_the_policy(case, tiny_model_dir, tmp_path):
    trainer = train(
        STAPOTrainer, STAPOConfig, tiny_model_dir, tmp_path, peft=case.get("peft", False), **case["overrides"]
    )
    kl = logged(trainer, "kl")
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-6) and max(kl) > 0  # the policy moved off the reference
    assert len(logged(trainer, "s2t/silenced_fraction")) == 3
    expected = "trl_pass" if case["overrides"].get("num_iterations", 1) > 1 else "generate"
    assert trainer.token_stats.origin == expected


def test_with_nothing_silenced_a_kl_penalized_stapo_run_is_grpo_bit_for_bit(tiny_model_dir, tmp_path):
    """With TRL's old-log-prob pass (num_iterations 2), where the reference pass and the policy's pass both run while
    STAPO captures statistics. GRPO gets STAPO's epsilon_high default, 0.28."""
    grpo = train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "grpo", num_iterations=2, epsilon_high=0.28)
    stapo = train(
        STAPOTrainer, STAPOConfig, tiny_model_dir, tmp_path / "stapo", num_iterations=2, prob_threshold=1e-30
    )
    assert logged(stapo, "s2t/num_silenced") == [0.0, 0.0, 0.0]
    for key in ("loss", "kl", "grad_norm"):
        assert logged(stapo, key) == logged(grpo, key), key
    for (name, left), (_, right) in zip(grpo.model.named_parameters(), stapo.model.named_parameters(), strict=True):
        assert torch.equal(left, right), name
