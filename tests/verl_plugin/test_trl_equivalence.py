"""verl's own ``ppo_loss``, with the plugin's ``loss_mode``, gives the loss, the gradient and the mask of stapo-trl's
TRL path on the same tensors, in float64.

The TRL side is ``STAPOTrainer``: its token rules applied to a hand-made micro-batch (``apply_token_rules``), then
TRL's own loss (``compute_loss``), whose per-token log-probabilities are the given float64 tensor (the model's pass is
replaced by it). The verl side lays the same tensors out as verl's actor does (``stapo_trl.verl.actor_batch``) and
calls verl's ``ppo_loss``. Both are differentiated with respect to that tensor; a token that left the loss has a zero
gradient, which is how the mask is read off verl's path. The batches carry no old log-probabilities, so the ratio is 1
on both sides. One micro-batch is one optimizer step here, as in a verl run with one micro-batch per rank and
mini-batch (tests/verl_plugin/test_verl_batching.py covers several).
"""

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
from loss_batches import make_batch, make_trainer  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY  # noqa: E402
from verl_loss_calls import verl_loss  # noqa: E402

from stapo_trl.file_and_metric_names import SILENCED_KEY  # noqa: E402
from stapo_trl.verl.losses import register_s2t_loss  # noqa: E402

ROWS, TOKENS = 4, 5
ADVANTAGES = [1.5, 0.5, -1.0, 2.0]
COMPLETION_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
THRESHOLDS = {"prob_threshold": 0.05, "entropy_quantile": 0.5}
TRL_LOSS_TYPE_OF = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
"""Each verl ``loss_agg_mode`` and the TRL ``loss_type`` that aggregates as it does (docs/verl.md)."""
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def statistics(seed=0):
    """Float64 log-probabilities between log(0.001) and log(0.9), about half below log(0.05), and entropies."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.empty(ROWS, TOKENS, dtype=torch.float64).uniform_(-6.9, -0.1, generator=generator)
    entropies = torch.empty(ROWS, TOKENS, dtype=torch.float64).uniform_(0.05, 3.0, generator=generator)
    return log_probs, entropies


def trl_side(tmp_path, log_probs, entropies, **overrides):
    """TRL's loss after stapo-trl's rules, its gradient with respect to ``log_probs``, and the batch."""
    trainer = make_trainer(
        tmp_path, per_device_train_batch_size=ROWS, num_generations=2, max_completion_length=TOKENS, **overrides
    )
    batch = make_batch(log_probs.clone(), entropies.clone(), ADVANTAGES, COMPLETION_MASK.clone())
    trainer.apply_token_rules([batch])
    leaf = log_probs.clone().requires_grad_(True)
    model_pass = trainer._get_per_token_logps_and_entropies

    def given_tensors(*args, **kwargs):
        _, model_entropies, aux = model_pass(*args, **kwargs)
        return leaf, None if model_entropies is None else entropies.clone(), aux

    trainer._get_per_token_logps_and_entropies = given_tensors
    loss = trainer.compute_loss(trainer.model, batch)
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss, gradient, batch


def verl_side(log_probs, entropies, loss_mode, loss_agg_mode):
    """verl's ppo_loss on the same tensors, in verl's layout with the engine's global batch info, and its gradient
    with respect to ``log_probs``."""
    (loss,), gradient, (metrics,) = verl_loss(
        log_probs, entropies, ADVANTAGES, COMPLETION_MASK, loss_mode, loss_agg_mode
    )
    return loss, gradient, metrics


@pytest.fixture
def loss_modes():
    """Registers an S2T loss mode with the test's thresholds; removed afterwards."""
    added = []

    def register(name, **settings):
        register_s2t_loss(name, **settings)
        added.append(name)
        return name

    yield register
    for name in added:
        POLICY_LOSS_REGISTRY.pop(name, None)


@pytest.mark.parametrize("loss_agg_mode", sorted(TRL_LOSS_TYPE_OF))
def test_stapo_equals_the_trl_path(tmp_path, loss_modes, loss_agg_mode):
    log_probs, entropies = statistics()
    mode = loss_modes("stapo_test", **THRESHOLDS)
    verl_loss, verl_gradient, metrics = verl_side(log_probs, entropies, mode, loss_agg_mode)
    trl_loss, trl_gradient, batch = trl_side(
        tmp_path, log_probs, entropies, loss_type=TRL_LOSS_TYPE_OF[loss_agg_mode], **THRESHOLDS
    )

    silenced = batch[SILENCED_KEY]
    assert 0 < int(silenced.sum()) < metrics["actor/s2t/num_candidates"].values[0]
    assert torch.equal((verl_gradient == 0) & COMPLETION_MASK.bool(), silenced)
    assert torch.equal((trl_gradient == 0) & COMPLETION_MASK.bool(), silenced)
    assert metrics["actor/s2t/num_silenced"].values == [int(silenced.sum())]
    assert verl_loss.dtype == trl_loss.dtype == torch.float64
    torch.testing.assert_close(verl_loss, trl_loss, **TOLERANCE)
    torch.testing.assert_close(verl_gradient, trl_gradient, **TOLERANCE)


@pytest.mark.parametrize(("loss_mode", "variant"), [("stare", "O1"), ("stare_c2", "C2")])
def test_stare_equals_the_trl_path_with_the_gate_on(tmp_path, loss_mode, variant):
    log_probs, entropies = statistics()
    verl_loss, verl_gradient, metrics = verl_side(log_probs, entropies, loss_mode, "token-mean")
    overrides = {"use_s2t_mask": False, "use_stare": True, "stare_gate": "on", "stare_variant": variant}
    trl_loss, trl_gradient, _ = trl_side(tmp_path, log_probs, entropies, loss_type="dapo", **overrides)

    assert metrics["actor/stare/num_selected_positive"].values[0] >= 1
    if variant == "C2":
        assert metrics["actor/stare/num_selected_negative"].values[0] >= 1
    torch.testing.assert_close(verl_loss, trl_loss, **TOLERANCE)
    torch.testing.assert_close(verl_gradient, trl_gradient, **TOLERANCE)
    vanilla_loss, vanilla_gradient, _ = verl_side(log_probs, entropies, "vanilla", "token-mean")
    assert not torch.allclose(vanilla_gradient, verl_gradient)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prob_threshold": 0.0}, r"prob_threshold must be in \(0, 1\], got 0\.0"),
        ({"entropy_quantile": 80}, r"entropy_quantile must be in \[0, 1\], got 80.*entropy_quantile=0\.8"),
    ],
)
def test_a_registered_s2t_loss_refuses_thresholds_as_the_trainer_does(settings, message):
    with pytest.raises(ValueError, match=message):
        register_s2t_loss("stapo_out_of_range", **settings)
