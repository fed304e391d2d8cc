"""The gradient probe: the silenced tokens' share of the gradient at the weights, measured with TRL's own loss."""

import math

import pytest
import torch
from loss_batches import LOW, make_batch, make_trainer
from tiny import parameters, tiny_config, tiny_trainer, tools, train_losses
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.names import NUM_ITEMS_BEFORE_RULES_KEY
from stapo_trl.core.token_rules import spurious_token_candidates
from stapo_trl.core.token_rules.random_silencing import count_matched_draw
from stapo_trl.core.token_stats.statistics import side_effect_free_pass
from stapo_trl.research.gradient_probe import GradientProbe, gradient_share_statistics, share_over_baseline

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


def test_a_share_over_a_baseline_compares_grad_share_per_token_share():
    # S2T: 4% of |g|^2 for 1% of tokens; the baseline: 2% for 1%. S2T carries twice what a random draw does.
    assert share_over_baseline((0.04, 0.01), (0.02, 0.01)) == pytest.approx(2.0)
    assert share_over_baseline((0.04, 0.01), (0.02, 0.02)) == pytest.approx(4.0)
    assert math.isnan(share_over_baseline((0.04, 0.0), (0.02, 0.01)))
    assert math.isnan(share_over_baseline((0.04, 0.01), (0.0, 0.01)))


def test_a_count_matched_draw_takes_that_many_tokens_of_the_pools_and_no_other():
    pools = [torch.tensor([[True, False, True], [False, True, False]]), torch.tensor([[True, True, False]])]
    drawn = count_matched_draw(pools, 3, torch.Generator().manual_seed(0))
    assert [part.shape for part in drawn] == [pool.shape for pool in pools]
    assert sum(int(part.sum()) for part in drawn) == 3
    assert all(not (part & ~pool).any() for part, pool in zip(drawn, pools, strict=True))
    again = count_matched_draw(pools, 3, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(drawn, again, strict=True))
    everything = count_matched_draw(pools, 99, torch.Generator().manual_seed(0))
    assert all(torch.equal(part, pool) for part, pool in zip(everything, pools, strict=True))
    assert sum(int(part.sum()) for part in count_matched_draw(pools, 0, torch.Generator())) == 0


def test_the_baselines_draw_as_many_tokens_as_were_silenced_from_their_own_pools():
    """Row 0 has A > 0: tokens 0, 1 and 3 are candidates (p < 0.002), tokens 2 and 4 are not; S2T silenced tokens 0
    and 1. Row 1 has A < 0. The positive pool is row 0, the candidate pool row 0's tokens 0, 1 and 3."""
    log_probs = torch.tensor([[LOW, LOW, 0.0, LOW, 0.0], [LOW, LOW, LOW, 0.0, 0.0]])
    batch = make_batch(log_probs, torch.ones(2, 5), [1.0, -1.0])
    batch["stapo_silenced"] = torch.tensor([[True, True, False, False, False], [False] * 5])
    batch["stapo_shadow_silenced"] = torch.zeros(2, 5, dtype=torch.bool)
    candidates = [[True, True, False, True, False], [False] * 5]
    probe = GradientProbe(1, candidate_mask=lambda *tensors: spurious_token_candidates(*tensors, prob_threshold=0.002))
    for step in range(5):
        sets = probe.token_sets([batch], global_step=step, process_index=0).sets
        assert sets["kept"][0].tolist() == [[False, False, True, True, True], [True] * 5]
        positive, candidate = sets["random_positive"][0], sets["random_candidate"][0]
        assert int(positive.sum()) == int(candidate.sum()) == 2
        assert not positive[1].any()
        assert not (candidate & ~torch.tensor(candidates)).any()
    assert "random_candidate" not in GradientProbe(1).token_sets([batch], 0, 0).sets


def test_the_two_parts_add_up_to_the_gradient_of_the_whole_loss(tmp_path):
    """The probe's whole-gradient norm equals the norm of the gradient of TRL's loss over every token, computed
    directly: the silenced and kept parts split the loss exactly."""
    trainer = make_trainer(tmp_path, loss_type="dapo", prob_threshold=0.002)
    log_probs = torch.tensor([[LOW, LOW, 0.0], [0.0, 0.0, 0.0]])
    entropies = torch.tensor([[0.1, 0.5, 1.0], [1.0, 1.0, 1.0]])
    batch = make_batch(log_probs, entropies, [1.0, -1.0])
    trainer.apply_token_rules([batch])
    assert int(batch["stapo_silenced"].sum()) == 1
    model = trainer.accelerator.unwrap_model(trainer.model)
    with trainer.metrics_untouched():
        stats = GradientProbe(1).measure(trainer.compute_loss, model, [batch])

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
        **common,
    )
    probed = tiny_trainer(STAPOTrainer, config, callbacks=tools(gradient_probe_steps=1))
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
        for baseline in ("random_positive", "random_candidate"):
            assert entry[f"gradient_probe/{baseline}_num_tokens"] == entry["gradient_probe/num_silenced"]
            assert entry[f"gradient_probe/{baseline}_token_share"] == entry["gradient_probe/silenced_token_share"]
    assert sum(entry["gradient_probe/num_silenced"] for entry in steps) > 0
    # TRL's own metrics are the GRPO run's: the probe's extra loss passes logged nothing.
    grpo_steps = [entry for entry in grpo.state.log_history if "loss" in entry]
    for ours, theirs in zip(steps, grpo_steps, strict=True):
        for key in ("entropy", "clip_ratio/region_mean", "reward"):
            assert ours[key] == theirs[key]


def test_every_kth_step_is_probed_starting_with_the_first(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, prob_threshold=PROB_THRESHOLD, max_steps=3, loss_type="dapo")
    trainer = tiny_trainer(STAPOTrainer, config, callbacks=tools(gradient_probe_steps=2))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert ["gradient_probe/silenced_grad_sq_share" in entry for entry in steps] == [True, False, True]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "grpo"}, "Not with: loss_type='grpo'"),
        ({"loss_type": "dapo", "use_s2t_mask": False}, "no token rule is on or in shadow"),
    ],
)
def test_settings_the_probe_cannot_split_are_refused_when_the_trainer_is_built(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_trainer(
            STAPOTrainer, tiny_config(STAPOConfig, tmp_path, **overrides), callbacks=tools(gradient_probe_steps=1)
        )


def test_a_negative_probe_interval_is_refused():
    with pytest.raises(ValueError, match="gradient_probe_steps must be an integer >= 0"):
        tools(gradient_probe_steps=-1)


def with_attention_dropout(trainer, rate: float = 0.3):
    for module in trainer.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = rate
    return trainer


def test_with_dropout_on_the_probe_sees_the_training_gradient_and_leaves_the_run_unchanged(tmp_path):
    """The probe runs in the model's own mode, replaying the random state of each micro-batch's training forward:
    with attention dropout on, the whole gradient it measures is the one the step trains on (the logged grad_norm is
    its norm before clipping), and the run draws the same numbers as without the probe."""
    common = {"epsilon_high": 0.28, "max_steps": 3, "temperature": 1.0, "loss_type": "dapo", "max_grad_norm": 1e9}
    common.update(use_s2t_mask=False, shadow_token_rules=["s2t"], prob_threshold=PROB_THRESHOLD)
    plain = with_attention_dropout(tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path / "plain", **common)))
    plain.train()
    config = tiny_config(STAPOConfig, tmp_path / "probed", **common)
    probed = with_attention_dropout(tiny_trainer(STAPOTrainer, config, callbacks=tools(gradient_probe_steps=1)))
    probed.train()
    assert train_losses(probed) == train_losses(plain)
    expected = parameters(plain)
    for name, value in parameters(probed).items():
        assert torch.equal(value, expected[name]), name
    steps = [entry for entry in probed.state.log_history if "loss" in entry]
    for entry in steps:
        assert entry["gradient_probe/whole_grad_norm"] == pytest.approx(entry["grad_norm"], rel=1e-4)
        assert entry["gradient_probe/seconds"] > 0.0

    model = probed.model.train()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert not torch.equal(model(input_ids).logits, model(input_ids).logits), "dropout does not fire in this setup"


def test_the_probe_says_how_many_optimizer_steps_came_since_the_generation(tmp_path):
    config = tiny_config(
        STAPOConfig,
        tmp_path,
        prob_threshold=PROB_THRESHOLD,
        max_steps=4,
        loss_type="dapo",
        per_device_train_batch_size=4,
        steps_per_generation=2,
    )
    trainer = tiny_trainer(STAPOTrainer, config, callbacks=tools(gradient_probe_steps=1))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["gradient_probe/steps_since_generation"] for entry in steps] == [0, 1, 0, 1]
