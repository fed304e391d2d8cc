"""RANDOM silencing, the control for S2T: as many tokens as S2T would silence, drawn uniformly from the positive-advantage
loss tokens, renormalized the same way. Its whole implementation is one module, stapo_trl/core/token_rules/random_silencing.py."""

import math

import pytest
import torch
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.token_rules import apply_token_rules, spurious_token_mask
from stapo_trl.core.token_rules.random_silencing import random_silencing_mask
from stapo_trl.methods import method_preset

LOW, HIGH = math.log(0.001), math.log(0.9)


def two_responses():
    """Row 0 (A = +1) has four candidates with entropies 0.1, 0.2, 0.3, 0.4: tau_h = 0.1 + 0.8 * 0.3 = 0.34 silences
    three of them. Row 1 (A = -1) has no candidate. Row 0 has 6 loss tokens, all positive-advantage."""
    log_probs = torch.tensor([[LOW, LOW, LOW, LOW, HIGH, HIGH], [LOW, LOW, HIGH, HIGH, HIGH, HIGH]])
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 1.0, 1.0], [0.1, 0.1, 1.0, 1.0, 1.0, 1.0]])
    return log_probs, entropies, torch.tensor([1.0, -1.0]), torch.ones(2, 6, dtype=torch.bool)


def test_it_silences_as_many_tokens_as_s2t_drawn_from_positive_advantage_tokens():
    log_probs, entropies, advantages, loss_mask = two_responses()
    spurious, _ = spurious_token_mask(log_probs, entropies, advantages, loss_mask)
    assert int(spurious.sum()) == 3
    for seed in range(20):
        silenced, stats = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=seed)
        assert int(silenced.sum()) == 3 == stats["num_silenced"]
        assert not silenced[1].any()  # never a token of the negative-advantage response
        assert stats["num_positive"] == 6 and stats["num_tokens"] == 12
        assert stats["silenced_fraction"] == pytest.approx(3 / 12)
        assert stats["num_also_spurious"] == int((silenced & spurious).sum())


def test_the_draw_is_uniform_over_the_positive_tokens_and_fixed_by_the_seed():
    log_probs, entropies, advantages, loss_mask = two_responses()
    counts = torch.zeros(6)
    for seed in range(600):
        silenced, _ = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=seed)
        counts += silenced[0].float()
    # Each of the 6 positive tokens is drawn with probability 3/6: 300 expected in 600 draws (sd about 12).
    assert all(240 < count < 360 for count in counts.tolist()), counts
    first, _ = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=7)
    again, _ = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=7)
    assert torch.equal(first, again)


def test_it_does_not_touch_torchs_global_random_stream():
    log_probs, entropies, advantages, loss_mask = two_responses()
    state = torch.get_rng_state()
    random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_padding_is_never_drawn_and_fewer_positive_tokens_cap_the_count():
    log_probs, entropies, advantages, _ = two_responses()
    loss_mask = torch.zeros(2, 6, dtype=torch.bool)
    loss_mask[0, :2] = True  # two candidates, tau_h = 0.1 + 0.8 * 0.1 = 0.18: S2T silences one
    silenced, stats = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=0)
    assert stats["num_silenced"] == 1 and not silenced[~loss_mask].any()


def test_as_a_rule_it_drops_the_drawn_tokens():
    log_probs, entropies, advantages, loss_mask = two_responses()
    composed = apply_token_rules([("random_silencing", {"seed": 1})], log_probs, entropies, advantages, loss_mask)
    silenced, _ = random_silencing_mask(log_probs, entropies, advantages, loss_mask, seed=1)
    assert torch.equal(composed.keep, loss_mask & ~silenced) and composed.weights is None
    assert composed.stats["random_silencing"]["num_silenced"] == 3


def test_the_random_method_turns_s2t_off_and_the_control_on(tmp_path):
    preset = method_preset("random")
    assert preset.defaults["use_random_silencing"] is True and preset.defaults["use_s2t_mask"] is False
    config = tiny_config(STAPOConfig, tmp_path, **{**preset.defaults, "prob_threshold": 0.2})
    assert config.active_token_rules == ["random_silencing"]


def test_it_refuses_to_run_beside_s2t(tmp_path):
    with pytest.raises(ValueError, match="use_random_silencing=True is the control for S2T"):
        tiny_config(STAPOConfig, tmp_path, use_random_silencing=True)


def test_in_training_it_silences_what_s2t_in_shadow_would_count(tmp_path):
    """With S2T in shadow, both see the same loss tokens at every step: the control silences exactly as many tokens as
    S2T would have, and the parameters move."""
    config = tiny_config(
        STAPOConfig,
        tmp_path,
        use_s2t_mask=False,
        use_random_silencing=True,
        shadow_token_rules=["s2t"],
        prob_threshold=0.2,
        max_steps=3,
    )
    trainer = tiny_trainer(STAPOTrainer, config)
    before = {name: value.clone() for name, value in trainer.model.named_parameters()}
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 3
    drawn = [entry["random_silencing/num_silenced"] for entry in steps]
    assert drawn == [entry["shadow/s2t/num_silenced"] for entry in steps]
    assert sum(drawn) > 0
    assert any(not torch.equal(value, before[name]) for name, value in trainer.model.named_parameters())
