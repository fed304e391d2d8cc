"""Rules in shadow: computed and logged at every optimizer step, never applied. GRPO with S2T in shadow trains exactly as
GRPO and logs what S2T would have silenced."""

import pytest
import torch
from tiny import parameters, tiny_config, tiny_trainer, train_losses
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer

PROB_THRESHOLD = 0.2  # the tiny model is far less confident than a real one, so this makes S2T fire
COMMON = {"epsilon_high": 0.28, "max_steps": 3, "temperature": 1.0}


def grad_norms(trainer):
    return [entry["grad_norm"] for entry in trainer.state.log_history if "loss" in entry]


def test_grpo_with_s2t_in_shadow_trains_exactly_like_grpo_and_logs_what_s2t_would_silence(tmp_path):
    grpo = tiny_trainer(GRPOTrainer, tiny_config(GRPOConfig, tmp_path / "grpo", **COMMON))
    grpo.train()
    config = tiny_config(
        STAPOConfig,
        tmp_path / "shadow",
        use_s2t_mask=False,
        shadow_token_rules=["s2t"],
        prob_threshold=PROB_THRESHOLD,
        **COMMON,
    )
    shadow = tiny_trainer(STAPOTrainer, config)
    shadow.train()

    assert train_losses(shadow) == train_losses(grpo)
    assert grad_norms(shadow) == grad_norms(grpo)
    expected = parameters(grpo)
    for name, value in parameters(shadow).items():
        assert torch.equal(value, expected[name]), name
    steps = [entry for entry in shadow.state.log_history if "loss" in entry]
    would_silence = [entry["shadow/s2t/num_silenced"] for entry in steps]
    assert sum(would_silence) > 0
    assert not any(key.startswith("s2t/") for entry in steps for key in entry)
    assert all("token_stats/mean_entropy" in entry for entry in steps)


def test_at_the_first_step_shadow_s2t_counts_what_stapo_silences(tmp_path):
    """Both runs sample the same completions in step 1, so the shadow count equals STAPO's applied count there."""
    values = {**COMMON, "max_steps": 1, "prob_threshold": PROB_THRESHOLD}
    stapo = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path / "stapo", **values))
    stapo.train()
    shadow = tiny_trainer(
        STAPOTrainer,
        tiny_config(STAPOConfig, tmp_path / "shadow", use_s2t_mask=False, shadow_token_rules=["s2t"], **values),
    )
    shadow.train()
    (applied,) = [entry for entry in stapo.state.log_history if "loss" in entry]
    (logged,) = [entry for entry in shadow.state.log_history if "loss" in entry]
    for statistic in ("num_silenced", "num_candidates", "entropy_threshold"):
        assert logged[f"shadow/s2t/{statistic}"] == pytest.approx(applied[f"s2t/{statistic}"], nan_ok=True)
    assert applied["s2t/num_silenced"] > 0


def test_a_rule_cannot_be_applied_and_in_shadow(tmp_path):
    with pytest.raises(ValueError, match="shadow_token_rules lists s2t, which this run also applies"):
        tiny_config(STAPOConfig, tmp_path, shadow_token_rules=["s2t"])


def test_an_unknown_shadow_rule_is_named(tmp_path):
    with pytest.raises(ValueError, match="shadow_token_rules lists 'nope', which is not registered"):
        tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False, shadow_token_rules=["nope"])


def test_s2t_settings_count_as_used_when_s2t_runs_in_shadow(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False, shadow_token_rules=["s2t"], entropy_quantile=0.5)
    assert config.active_token_rules == [] and config.shadow_token_rules == ["s2t"]
    with pytest.raises(ValueError, match="entropy_quantile set, but use_s2t_mask=False"):
        tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False, entropy_quantile=0.5)
