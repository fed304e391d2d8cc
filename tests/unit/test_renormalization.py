"""The loss after masking equals hand-computed values: TRL's aggregation renormalized over the kept tokens.

The batches carry no old log-probabilities, so the importance ratio is exactly 1 and each token's clipped surrogate
is -A. Known statistics make the mask known: in row 0, tokens 0 and 2 are candidates (H = 0.1 and 0.5, so
tau_h = 0.1 + 0.8 * 0.4 = 0.42) and only token 0 is silenced. Row 1 has a negative advantage.
"""

import pytest
import torch
from loss_batches import HIGH, LOW, make_batch, make_trainer

from stapo_trl.core.names import NUM_ITEMS_BEFORE_RULES_KEY, SILENCED_KEY, TOOL_MASK_BEFORE_RULES_KEY


def known_batch():
    log_probs = torch.tensor([[LOW, HIGH, LOW], [LOW, LOW, LOW]])
    entropies = torch.tensor([[0.1, 0.3, 0.5], [0.0, 0.0, 0.0]])
    return make_batch(log_probs, entropies, [1.0, -0.5])


# Kept: row 0 tokens 1, 2 (-A = -1 each); row 1 all three (-A = +0.5 each). Five kept tokens, sum = -0.5.
EXPECTED_MASKED_LOSS = {
    "dapo": -0.5 / 5,
    "bnpo": -0.5 / 5,
    "grpo": (-1.0 + 0.5) / 2,
    "dr_grpo": -0.5 / (2 * 3),
}
# Without the mask: six tokens, sum = -3 + 1.5 = -1.5.
EXPECTED_UNMASKED_LOSS = {"dapo": -1.5 / 6, "bnpo": -1.5 / 6, "grpo": (-1.0 + 0.5) / 2, "dr_grpo": -1.5 / 6}


@pytest.mark.parametrize("loss_type", sorted(EXPECTED_MASKED_LOSS))
def test_masked_loss_is_renormalized_over_kept_tokens(tmp_path, loss_type):
    trainer = make_trainer(tmp_path, loss_type=loss_type)
    batch = known_batch()
    stats = trainer.apply_token_rules([batch])["s2t"]
    assert batch[SILENCED_KEY].tolist() == [[True, False, False], [False, False, False]]
    assert stats["entropy_threshold"] == pytest.approx(0.42)
    assert batch["num_items_in_batch"].item() == 5
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(EXPECTED_MASKED_LOSS[loss_type], rel=1e-6)


@pytest.mark.parametrize("loss_type", sorted(EXPECTED_UNMASKED_LOSS))
def test_the_same_batch_without_the_mask_gives_trl_loss(tmp_path, loss_type):
    trainer = make_trainer(tmp_path, loss_type=loss_type)
    batch = known_batch()
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(EXPECTED_UNMASKED_LOSS[loss_type], rel=1e-6)


def test_cispo_is_renormalized_too(tmp_path):
    trainer = make_trainer(tmp_path, loss_type="cispo", epsilon_high=5.0)
    batch = known_batch()
    trainer.apply_token_rules([batch])
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        log_probs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 3)
    keep = ~batch[SILENCED_KEY]
    per_token = -batch["advantages"].unsqueeze(1) * log_probs  # ratio 1, below the epsilon_high=5 cap
    expected = per_token[keep].sum() / keep.sum()
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_padding_stays_out_of_the_kept_count(tmp_path):
    trainer = make_trainer(tmp_path, loss_type="dapo")
    batch = known_batch()
    batch["completion_mask"] = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch[NUM_ITEMS_BEFORE_RULES_KEY] = torch.tensor(5)
    trainer.apply_token_rules([batch])
    assert batch["num_items_in_batch"].item() == 4
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 4, rel=1e-6)


def test_tool_tokens_stay_silenced_and_uncounted(tmp_path):
    trainer = make_trainer(tmp_path, loss_type="dapo")
    batch = known_batch()
    tool_mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    batch[TOOL_MASK_BEFORE_RULES_KEY] = tool_mask
    batch[NUM_ITEMS_BEFORE_RULES_KEY] = torch.tensor(5)
    trainer.apply_token_rules([batch])
    assert batch["tool_mask"].tolist() == [[0, 1, 1], [1, 0, 1]]
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 4, rel=1e-6)


def test_silenced_tokens_scale_with_optimizer_steps_per_generation(tmp_path):
    # Two optimizer steps per generation: TRL's dapo normalizer is num_items * GA / steps_per_generation, so the
    # step's silenced tokens are removed at generation scale (2 per silenced token).
    trainer = make_trainer(tmp_path, loss_type="dapo", steps_per_generation=2)
    batch = known_batch()
    batch[NUM_ITEMS_BEFORE_RULES_KEY] = batch["num_items_in_batch"] = torch.tensor(12)
    trainer.apply_token_rules([batch])
    assert batch["num_items_in_batch"].item() == 12 - 2
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(-0.5 / 5, rel=1e-6)


def test_with_several_steps_per_generation_the_dapo_count_is_trls_average_minus_the_silenced_tokens(tmp_path):
    # TRL divides each step by the generation's tokens per step on average (14 tokens over 2 steps: 7), not by the
    # step's own 6. With one token silenced the count is 7 - 1 = 6 against 5 kept: as inexact as TRL's own 7 vs 6.
    trainer = make_trainer(tmp_path, loss_type="dapo", steps_per_generation=2)
    batch = known_batch()
    batch[NUM_ITEMS_BEFORE_RULES_KEY] = batch["num_items_in_batch"] = torch.tensor(14)
    trainer.apply_token_rules([batch])
    assert batch["num_items_in_batch"].item() == 14 - 2
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(-0.5 / 6, rel=1e-6)


def test_under_grpo_a_fully_silenced_sequence_counts_as_zero_in_the_mean_over_sequences(tmp_path):
    # Row 0: all three tokens are candidates with H = 0.1; row 1 (positive too) has three candidates with H = 0.9.
    # tau_h, the 0.8-quantile of three 0.1s and three 0.9s, is 0.9, so row 0 is silenced whole and row 1 kept. TRL's grpo loss averages the
    # per-sequence means over all B sequences, so row 0 adds 0 and still counts: (0 + (-0.5)) / 2, not -0.5 / 1.
    trainer = make_trainer(tmp_path, loss_type="grpo")
    batch = make_batch(torch.full((2, 3), LOW), torch.tensor([[0.1] * 3, [0.9] * 3]), [1.0, 0.5])
    trainer.apply_token_rules([batch])
    assert batch[SILENCED_KEY].tolist() == [[True] * 3, [False] * 3]
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx((0.0 - 0.5) / 2, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_an_all_masked_micro_batch_gives_finite_zero_loss_and_zero_gradient(tmp_path, loss_type):
    # One optimizer step of two micro-batches. Every token is a candidate; the first micro-batch holds the
    # low-entropy half (H = 0), the second the high-entropy half (H = 1), so tau_h = 1 and the first is fully silenced.
    trainer = make_trainer(tmp_path, loss_type=loss_type, gradient_accumulation_steps=2)
    low_entropy = make_batch(torch.full((2, 3), LOW), torch.zeros(2, 3), [1.0, 0.5], num_items=torch.tensor(12))
    high_entropy = make_batch(torch.full((2, 3), LOW), torch.ones(2, 3), [1.0, 0.5], num_items=torch.tensor(12))
    stats = trainer.apply_token_rules([low_entropy, high_entropy])["s2t"]
    assert stats["entropy_threshold"] == pytest.approx(1.0)
    assert low_entropy[SILENCED_KEY].all() and not high_entropy[SILENCED_KEY].any()

    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, low_entropy)
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is None or torch.all(parameter.grad == 0), name

    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, high_entropy).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
