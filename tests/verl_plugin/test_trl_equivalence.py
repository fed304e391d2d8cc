"""verl's own ``ppo_loss``, with the plugin's ``loss_mode``, gives the loss, the gradient and the mask of stapo-trl's
TRL path on the same tensors, in float64.

The TRL side is ``STAPOTrainer``: its token rules applied to a hand-made micro-batch (``apply_token_rules``), then
TRL's own loss (``compute_loss``), whose per-token log-probabilities are the given float64 tensor (the model's pass is
replaced by it). The verl side lays the same tensors out as verl's actor does (``stapo_trl.verl.actor_batch``) and
calls verl's ``ppo_loss``. Both are differentiated with respect to that tensor; a token that left the loss has a zero
gradient, which is how the mask is read off verl's path. The batches carry no old log-probabilities, so the ratio is 1
on both sides. One micro-batch is one optimizer step here, as in a verl run with one micro-batch per rank and
mini-batch (tests/verl_plugin/test_verl_batching.py covers several).

Each comparison runs on both layouts that reach verl's loss: the v0 trainer's padded batch and the v1 trainer's
(verl's default) nested one. The last tests go one step further up verl's actor: the model output is built by verl's
FSDP engine (``prepare_model_inputs`` and ``prepare_model_outputs``) from logits, with ``use_remove_padding`` packing
the micro-batch into one row or not, and TRL computes its log-probabilities and entropies from the same logits with its
own functions; both sides are differentiated with respect to the weights that make the logits.
"""

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
from loss_batches import make_batch, make_trainer  # noqa: E402
from trl.trainer.utils import entropy_from_logits, selective_log_softmax  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY  # noqa: E402
from verl_loss_calls import engine_loss, metric, verl_loss  # noqa: E402

from stapo_trl.core.names import SILENCED_KEY  # noqa: E402
from stapo_trl.verl.actor_batch import LAYOUTS, actor_mini_batch, sequence_lengths  # noqa: E402
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


def trl_loss(tmp_path, log_probs, entropies, **overrides):
    """TRL's loss after stapo-trl's rules, with the model's per-token log-probabilities replaced by ``log_probs``
    (which may carry autograd history), and the batch."""
    trainer = make_trainer(
        tmp_path, per_device_train_batch_size=ROWS, num_generations=2, max_completion_length=TOKENS, **overrides
    )
    batch = make_batch(log_probs.detach().clone(), entropies.detach().clone(), ADVANTAGES, COMPLETION_MASK.clone())
    trainer.apply_token_rules([batch])
    model_pass = trainer._get_per_token_logps_and_entropies

    def given_tensors(*args, **kwargs):
        _, model_entropies, aux = model_pass(*args, **kwargs)
        return log_probs, None if model_entropies is None else entropies.detach().clone(), aux

    trainer._get_per_token_logps_and_entropies = given_tensors
    return trainer.compute_loss(trainer.model, batch), batch


def trl_side(tmp_path, log_probs, entropies, **overrides):
    """TRL's loss after stapo-trl's rules, its gradient with respect to ``log_probs``, and the batch."""
    leaf = log_probs.clone().requires_grad_(True)
    loss, batch = trl_loss(tmp_path, leaf, entropies, **overrides)
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss, gradient, batch


def verl_side(log_probs, entropies, loss_mode, loss_agg_mode, layout="v0"):
    """verl's ppo_loss on the same tensors, in verl's ``layout`` with the engine's global batch info, and its
    gradient with respect to ``log_probs``."""
    (loss,), gradient, (metrics,) = verl_loss(
        log_probs, entropies, ADVANTAGES, COMPLETION_MASK, loss_mode, loss_agg_mode, layout=layout
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


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_agg_mode", sorted(TRL_LOSS_TYPE_OF))
def test_stapo_equals_the_trl_path(tmp_path, loss_modes, loss_agg_mode, layout):
    log_probs, entropies = statistics()
    mode = loss_modes("stapo_test", **THRESHOLDS)
    verl_loss, verl_gradient, metrics = verl_side(log_probs, entropies, mode, loss_agg_mode, layout)
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


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("loss_mode", "variant"), [("stare", "O1"), ("stare_c2", "C2")])
def test_stare_equals_the_trl_path_with_the_gate_on(tmp_path, loss_mode, variant, layout):
    log_probs, entropies = statistics()
    verl_loss, verl_gradient, metrics = verl_side(log_probs, entropies, loss_mode, "token-mean", layout)
    overrides = {"use_s2t_mask": False, "use_stare": True, "stare_gate": "on", "stare_variant": variant}
    trl_loss, trl_gradient, _ = trl_side(tmp_path, log_probs, entropies, loss_type="dapo", **overrides)

    assert metrics["actor/stare/num_selected_positive"].values[0] >= 1
    if variant == "C2":
        assert metrics["actor/stare/num_selected_negative"].values[0] >= 1
    torch.testing.assert_close(verl_loss, trl_loss, **TOLERANCE)
    torch.testing.assert_close(verl_gradient, trl_gradient, **TOLERANCE)
    vanilla_loss, vanilla_gradient, _ = verl_side(log_probs, entropies, "vanilla", "token-mean", layout)
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


VOCABULARY, POSITIONS = 16, 16


class TinyLM(torch.nn.Module):
    """Logits that depend on the input token and its position, in float64: a stand-in model, whose weights both sides
    differentiate."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.nn.Parameter(
            3 * torch.randn(VOCABULARY, VOCABULARY, dtype=torch.float64, generator=generator)
        )
        self.positions = torch.nn.Parameter(
            torch.randn(POSITIONS, VOCABULARY, dtype=torch.float64, generator=generator)
        )

    def forward(self, input_ids, position_ids):
        return self.tokens[input_ids] + self.positions[position_ids]

    def response_logits(self, prompt_lengths: list[int]) -> torch.Tensor:
        """``[B, T, V]``: the logits that score each response token, as a padded causal LM computes them (the
        prompt and response token ids are those of ``stapo_trl.verl.actor_batch``)."""
        rows = []
        for prompt_length in prompt_lengths:
            sequence = torch.cat([torch.arange(3, 3 + prompt_length), torch.arange(10, 10 + TOKENS)])
            scoring = torch.arange(prompt_length - 1, prompt_length - 1 + TOKENS)
            rows.append(self(sequence[scoring], scoring))
        return torch.stack(rows)


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stapo_on_the_fsdp_engine_output_equals_the_trl_path(tmp_path, loss_modes, layout, use_remove_padding):
    mode = loss_modes("stapo_test", **THRESHOLDS)
    verl_model, trl_model = TinyLM(), TinyLM()
    (verl_loss_value,), (metrics,) = engine_loss(
        verl_model,
        ADVANTAGES,
        COMPLETION_MASK,
        mode,
        use_remove_padding=use_remove_padding,
        layout=layout,
        micro_batch_size=ROWS,
    )
    layout_batch = actor_mini_batch(
        torch.zeros(ROWS, TOKENS), torch.tensor(ADVANTAGES), COMPLETION_MASK, layout=layout
    )
    logits = trl_model.response_logits(sequence_lengths(layout_batch)[0])
    labels = torch.arange(10, 10 + TOKENS).expand(ROWS, TOKENS)
    log_probs, entropies = selective_log_softmax(logits, labels), entropy_from_logits(logits)
    trl_loss_value, batch = trl_loss(tmp_path, log_probs, entropies, loss_type="dapo", **THRESHOLDS)
    trl_loss_value.backward()

    silenced = int(batch[SILENCED_KEY].sum())
    assert 0 < silenced < metric(metrics, "actor/s2t/num_candidates")
    assert metric(metrics, "actor/s2t/num_silenced") == silenced
    torch.testing.assert_close(verl_loss_value, trl_loss_value.detach(), **TOLERANCE)
    for name, weight in verl_model.named_parameters():
        torch.testing.assert_close(weight.grad, dict(trl_model.named_parameters())[name].grad, **TOLERANCE)
