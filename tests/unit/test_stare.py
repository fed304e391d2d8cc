"""STARE by hand: the top-surprisal selection, the weights of O1 and C2, the gate and the adaptive schedule.

Surprisal is s = -log p, so a smaller probability is a larger surprisal. Each case below gives probabilities and
lists which tokens must be selected.
"""

import json
import math

import pytest
import torch

from stapo_trl.core.token_rules import STAREController, stare_token_weights, top_share_mask


def log(values):
    return torch.log(torch.tensor(values, dtype=torch.float32))


W, M = 1.1, 0.9


def test_the_four_quadrants_under_c2():
    # Row 0 has A > 0, row 1 has A < 0. In each row one token is high-surprisal (p = 0.01) and three are not.
    log_probs = log([[0.5, 0.01, 0.6, 0.7], [0.8, 0.9, 0.01, 0.5]])
    result = stare_token_weights(log_probs, torch.tensor([1.0, -1.0]), torch.ones(2, 4), variant="C2")
    # ceil(0.1 * 4) = 1 token per sign: the high-surprisal one.
    assert result.selected_positive.tolist() == [[False, True, False, False], [False] * 4]
    assert result.selected_negative.tolist() == [[False] * 4, [False, False, True, False]]
    assert torch.allclose(result.weights, torch.tensor([[1, W, 1, 1], [1, 1, M, 1]]))
    assert result.stats["num_selected_positive"] == result.stats["num_selected_negative"] == 1
    assert result.stats["mean_weight"] == pytest.approx((6 + W + M) / 8)


def test_o1_leaves_the_negative_side_at_weight_one():
    log_probs = log([[0.5, 0.01, 0.6, 0.7], [0.8, 0.9, 0.01, 0.5]])
    result = stare_token_weights(log_probs, torch.tensor([1.0, -1.0]), torch.ones(2, 4), variant="O1")
    assert torch.allclose(result.weights, torch.tensor([[1, W, 1, 1], [1, 1, 1, 1]]))
    assert not result.selected_negative.any()
    assert result.stats["num_negative"] == 4 and result.stats["num_selected_negative"] == 0


def test_c2_negative_side_selects_its_own_top_share():
    # Ten negative tokens, P = 0.2: k = 2, the two smallest probabilities, whatever the positive side holds.
    probabilities = [0.9, 0.05, 0.8, 0.7, 0.02, 0.6, 0.5, 0.4, 0.3, 0.2]
    result = stare_token_weights(
        log([probabilities]), torch.tensor([-2.0]), torch.ones(1, 10), variant="C2", top_surprisal_share=0.2
    )
    assert result.selected_negative[0].nonzero().flatten().tolist() == [1, 4]
    expected = [M if index in (1, 4) else 1.0 for index in range(10)]
    assert result.weights[0].tolist() == pytest.approx(expected)
    assert not result.selected_positive.any()


def test_zero_advantage_is_never_selected():
    # The A = 0 row holds the most surprising tokens; even with P = 1 it gets weight 1.
    log_probs = log([[0.0001, 0.0001], [0.5, 0.6], [0.5, 0.6]])
    result = stare_token_weights(
        log_probs, torch.tensor([0.0, 1.0, -1.0]), torch.ones(3, 2), variant="C2", top_surprisal_share=1.0
    )
    assert result.selected_positive.tolist() == [[False, False], [True, True], [False, False]]
    assert result.selected_negative.tolist() == [[False, False], [False, False], [True, True]]
    assert result.weights[0].tolist() == [1.0, 1.0]
    assert result.stats["num_positive"] == result.stats["num_negative"] == 2


def test_top_k_is_a_ceiling_and_ties_at_the_boundary_are_all_selected():
    # Ten positive tokens, P = 0.25: k = ceil(2.5) = 3. Sorted surprisal: 0.01, 0.02, then 0.03 three times; the
    # third-largest is 0.03, and all three tokens at 0.03 are selected (5 in all), whatever their position.
    probabilities = [0.5, 0.03, 0.01, 0.6, 0.03, 0.7, 0.02, 0.8, 0.03, 0.9]
    result = stare_token_weights(
        log([probabilities]), torch.tensor([1.0]), torch.ones(1, 10), top_surprisal_share=0.25
    )
    assert result.selected_positive[0].nonzero().flatten().tolist() == [1, 2, 4, 6, 8]


def test_a_tie_at_the_top_selects_both_tokens():
    probabilities = [0.01, 0.5, 0.01, 0.6, 0.7, 0.8, 0.9, 0.4, 0.3, 0.2]
    result = stare_token_weights(log([probabilities]), torch.tensor([1.0]), torch.ones(1, 10))
    # k = ceil(0.1 * 10) = 1, but two tokens share the largest surprisal.
    assert result.selected_positive[0].nonzero().flatten().tolist() == [0, 2]


def test_k_does_not_round_up_float_noise():
    # 0.1 * 30 is 3.0000000000000004 in floating point; k must be 3, not 4.
    probabilities = [0.01 * (index + 1) for index in range(30)]
    result = stare_token_weights(log([probabilities]), torch.tensor([1.0]), torch.ones(1, 30))
    assert result.selected_positive[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_one_candidate_is_always_selected():
    result = stare_token_weights(log([[0.9, 0.8]]), torch.tensor([1.0]), torch.ones(1, 2), top_surprisal_share=0.01)
    assert result.selected_positive.tolist() == [[False, True]]


def test_padding_is_never_selected_and_keeps_weight_one():
    loss_mask = torch.tensor([[1, 1, 0]])
    result = stare_token_weights(log([[0.5, 0.4, 0.0001]]), torch.tensor([1.0]), loss_mask)
    assert result.selected_positive.tolist() == [[False, True, False]]
    assert torch.allclose(result.weights, torch.tensor([[1, W, 1]]))
    assert result.stats["num_tokens"] == 2


def test_per_token_advantages_split_each_row_by_sign():
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    result = stare_token_weights(
        log([[0.1, 0.2, 0.3, 0.05]]), advantages, torch.ones(1, 4), variant="C2", top_surprisal_share=0.5
    )
    assert torch.allclose(result.weights, torch.tensor([[W, 1, 1, M]]))


def test_nan_log_probabilities_are_never_selected():
    log_probs = torch.tensor([[float("nan"), math.log(0.5), math.log(0.6)]])
    result = stare_token_weights(log_probs, torch.tensor([1.0]), torch.ones(1, 3))
    assert result.selected_positive.tolist() == [[False, True, False]]


def test_gate_off_keeps_every_weight_at_one_but_still_reports_the_selection():
    log_probs = log([[0.5, 0.01, 0.6, 0.7], [0.8, 0.9, 0.01, 0.5]])
    result = stare_token_weights(log_probs, torch.tensor([1.0, -1.0]), torch.ones(2, 4), variant="C2", gate_on=False)
    assert torch.equal(result.weights, torch.ones(2, 4))
    assert result.stats["num_selected_positive"] == 1 and result.stats["gate_on"] == 0.0
    assert result.stats["mean_weight"] == 1.0


def test_micro_batch_pools_select_within_each_group():
    # Rows 0-1 are micro-batch 0, rows 2-3 micro-batch 1. Pooled, P = 0.25 of 8 tokens picks the two tokens of
    # micro-batch 0 with p = 0.001 and 0.002; per micro-batch, each pool of 4 picks its own most surprising token.
    log_probs = log([[0.001, 0.5], [0.002, 0.6], [0.3, 0.4], [0.2, 0.7]])
    advantages = torch.ones(4)
    pooled = stare_token_weights(log_probs, advantages, torch.ones(4, 2), top_surprisal_share=0.25)
    assert pooled.selected_positive.tolist() == [[True, False], [True, False], [False, False], [False, False]]
    grouped = stare_token_weights(
        log_probs,
        advantages,
        torch.ones(4, 2),
        top_surprisal_share=0.25,
        groups=torch.tensor([0, 0, 1, 1]),
        across_processes=False,
    )
    assert grouped.selected_positive.tolist() == [[True, False], [False, False], [False, False], [True, False]]


def test_groups_cannot_pool_across_processes():
    with pytest.raises(ValueError, match="across_processes=False"):
        top_share_mask(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), 0.1, groups=torch.tensor([0, 1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "O3"}, r"variant must be one of \('O1', 'C2'\)"),
        ({"positive_weight": -1.0}, "non-negative"),
        ({"top_surprisal_share": 0.0}, r"share must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stare_token_weights(log([[0.5]]), torch.tensor([1.0]), torch.ones(1, 1), **kwargs)


# ---------------------------------------------------------------------------------------------- the controller


def test_the_gate_starts_on_and_switches_strictly_around_the_target():
    controller = STAREController(target_entropy=0.3)
    assert controller.gate_on
    controller.update(0.35)
    assert not controller.gate_on
    controller.update(0.29)
    assert controller.gate_on
    controller.update(0.3)  # at the target: not below it, so off
    assert not controller.gate_on
    controller.update(0.1)
    assert controller.gate_on and controller.batch_entropy == 0.1 and controller.num_updates == 4


def test_a_batch_without_finite_entropy_changes_nothing():
    controller = STAREController(target_entropy=0.3, adaptive=True)
    controller.update(0.5)
    before = controller.state_dict()
    controller.update(float("nan"))
    controller.update(float("inf"))
    assert controller.state_dict() == before


def test_fixed_weights_do_not_move_without_the_adaptive_schedule():
    controller = STAREController()
    for entropy in (0.1, 0.9, 0.1):
        controller.update(entropy)
    assert (controller.positive_weight, controller.negative_weight) == (1.1, 0.9)


def test_the_adaptive_schedule_steps_by_alpha_and_respects_its_clamps():
    controller = STAREController(target_entropy=0.3, adaptive=True, alpha=0.01)
    controller.update(0.2)  # below target: reweight more
    assert controller.positive_weight == pytest.approx(1.11) and controller.negative_weight == pytest.approx(0.89)
    for _ in range(100):
        controller.update(0.2)
    assert (controller.positive_weight, controller.negative_weight) == (1.5, 0.5)
    controller.update(0.3)  # exactly at target: sign 0, nothing moves
    assert (controller.positive_weight, controller.negative_weight) == (1.5, 0.5)
    for _ in range(100):
        controller.update(0.4)  # above target: back toward GRPO
    assert (controller.positive_weight, controller.negative_weight) == (1.0, 1.0)


def test_custom_clamps_bound_the_schedule():
    controller = STAREController(adaptive=True, alpha=0.1, max_positive_weight=1.2, min_negative_weight=0.8)
    for _ in range(10):
        controller.update(0.0)
    assert (controller.positive_weight, controller.negative_weight) == (1.2, 0.8)


def test_forced_gate_modes_ignore_the_entropy():
    always_on, always_off = STAREController(gate_mode="on"), STAREController(gate_mode="off")
    assert always_on.gate_on and not always_off.gate_on
    for controller in (always_on, always_off):
        controller.update(5.0)
        controller.update(0.0)
    assert always_on.gate_on and not always_off.gate_on


def test_state_round_trips_through_json():
    controller = STAREController(adaptive=True)
    for entropy in (0.1, 0.2, 0.5):
        controller.update(entropy)
    restored = STAREController(adaptive=True)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored == controller
    fresh = STAREController()
    assert fresh.state_dict()["batch_entropy"] is None  # NaN is stored as null
    with pytest.raises(KeyError, match="lacks"):
        fresh.load_state_dict({"gate_on": True})
