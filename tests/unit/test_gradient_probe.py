"""The gradient probe: the silenced tokens' share of the gradient at the weights, measured with TRL's own loss."""

import math

import pytest
import torch
from loss_batches import LOW, make_batch, make_trainer
from tiny import parameters, tiny_config, tiny_trainer, train_losses
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.gradient_probe import gradient_share_statistics
from stapo_trl.names import NUM_ITEMS_BEFORE_RULES_KEY
from stapo_trl.token_stats import side_effect_free_pass

PROB_THRESHOLD = 0.2


def test_the_share_and_the_cosines_of_two_orthogonal_parts():
    stats = gradient_share_statistics(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert stats["silenced_grad_sq_share"] == pytest.approx(0.5)
    assert stats["cosine_silenced_whole"] == pytest.approx(1 / math.sqrt(2))
    assert stats["cosine_silenced_kept"] == pytest.approx(0.0)
    assert stats["whole_grad_norm"] == pytest.approx(math.sqrt(2))


def test_a_part_that_cancels_the_rest_has_a_share_above_one_and_negative_cosines():
    stats = gradient_share_statistics(torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 0.0]))
    assert stats["silenced_grad_sq_share"] == pytest.approx(4.0)
    assert stats["cosine_silenced_kept"] == pytest.approx(-1.0)
    empty = gradient_share_statistics(torch.zeros(2), torch.tensor([0.0, 3.0]))
    assert empty["silenced_grad_sq_share"] == 0.0 and math.isnan(empty["cosine_silenced_whole"])


def test_the_two_parts_add_up_to_the_gradient_of_the_whole_loss(tmp_path):
    """The probe's whole-gradient norm equals the norm of the gradient of TRL's loss over every token, computed
    directly: the silenced and kept parts split the loss exactly."""
    trainer = make_trainer(tmp_path, loss_type="dapo", gradient_probe_steps=1, prob_threshold=0.002)
    log_probs = torch.tensor([[LOW, LOW, 0.0], [0.0, 0.0, 0.0]])
    entropies = torch.tensor([[0.1, 0.5, 1.0], [1.0, 1.0, 1.0]])
    batch = make_batch(log_probs, entropies, [1.0, -1.0])
    trainer.apply_token_rules([batch])
    assert int(batch["stapo_silenced"].sum()) == 1
    stats = trainer.probe_gradient_share([batch])

    model = trainer.accelerator.unwrap_model(trainer.model)
    whole = dict(batch)
    whole["tool_mask"] = torch.ones_like(batch["completion_mask"])
    whole["num_items_in_batch"] = batch[NUM_ITEMS_BEFORE_RULES_KEY]
    with trainer.metrics_untouched(), side_effect_free_pass(model):
        loss = trainer.compute_loss(model, whole)
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))
    assert stats["whole_grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert stats["silenced_grad_sq_share"] > 0.0
    assert stats["silenced_token_share"] == pytest.approx(1 / 6)
    assert all(p.grad is None for p in model.parameters())


def test_grpo_with_s2t_in_shadow_and_the_probe_still_trains_exactly_like_grpo(tmp_path):
    common = {"epsilon_high": 0.28, "max_steps": 2, "temperature": 1.0, "loss_type": "dapo"}
    grpo = tiny_trainer(GRPOTrainer, tiny_config(GRPOConfig, tmp_path / "grpo", **common))
    grpo.train()
    config = tiny_config(
        STAPOConfig,
        tmp_path / "probe",
        use_s2t_mask=False,
        shadow_token_rules=["s2t"],
        prob_threshold=PROB_THRESHOLD,
        gradient_probe_steps=1,
        **common,
    )
    probed = tiny_trainer(STAPOTrainer, config)
    probed.train()
    assert train_losses(probed) == train_losses(grpo)
    expected = parameters(grpo)
    for name, value in parameters(probed).items():
        assert torch.equal(value, expected[name]), name
    steps = [entry for entry in probed.state.log_history if "loss" in entry]
    for entry in steps:
        assert entry["gradient_probe/silenced_token_share"] == pytest.approx(entry["shadow/s2t/silenced_fraction"])
        assert entry["gradient_probe/num_silenced"] == entry["shadow/s2t/num_silenced"]
        assert entry["gradient_probe/silenced_grad_sq_share"] >= 0.0
    assert sum(entry["gradient_probe/num_silenced"] for entry in steps) > 0
    # TRL's own metrics are the GRPO run's: the probe's extra loss passes logged nothing.
    grpo_steps = [entry for entry in grpo.state.log_history if "loss" in entry]
    for ours, theirs in zip(steps, grpo_steps, strict=True):
        for key in ("entropy", "clip_ratio/region_mean", "reward"):
            assert ours[key] == theirs[key]


def test_every_kth_step_is_probed_starting_with_the_first(tmp_path):
    config = tiny_config(
        STAPOConfig, tmp_path, prob_threshold=PROB_THRESHOLD, gradient_probe_steps=2, max_steps=3, loss_type="dapo"
    )
    trainer = tiny_trainer(STAPOTrainer, config)
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert ["gradient_probe/silenced_grad_sq_share" in entry for entry in steps] == [True, False, True]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "grpo"}, "Not with: loss_type='grpo'"),
        ({"loss_type": "dapo", "use_s2t_mask": False}, "no token rule is on or in shadow"),
        ({"loss_type": "dapo", "gradient_probe_steps": -1}, "must be an integer >= 0"),
    ],
)
def test_settings_the_probe_cannot_split_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(STAPOConfig, tmp_path, **{"gradient_probe_steps": 1, **overrides})
