"""The S2T mask (STAPO Algorithm 1) on hand-computed cases."""

import math

import pytest
import torch

from stapo_trl import linear_quantiles, logit_grad_sq_norm_lower_bound, spurious_token_mask

LOW = math.log(0.001)  # p = 0.001 < 0.002: a candidate when its advantage is positive
HIGH = math.log(0.5)  # p = 0.5: never a candidate


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_lowest_entropy_share_of_candidates_is_silenced():
    # Five candidates with H = 0.1 ... 0.5. tau_h = 0.8-quantile = 0.4 + 0.2 * (0.5 - 0.4) = 0.42.
    log_probs = row([LOW] * 5)
    entropies = row([0.5, 0.1, 0.4, 0.2, 0.3])
    spurious, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 5))
    assert stats["entropy_threshold"] == pytest.approx(0.42)
    assert spurious.tolist() == [[False, True, True, True, True]]
    assert stats["num_candidates"] == 5
    assert stats["num_spurious"] == 4


def test_entropy_quantile_direction_follows_q():
    log_probs = row([LOW] * 5)
    entropies = row([0.1, 0.2, 0.3, 0.4, 0.5])
    masks = {
        q: spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 5), entropy_quantile=q)[0]
        for q in (0.0, 0.25, 0.5, 1.0)
    }
    assert masks[0.0].sum() == 0  # tau_h = min: nothing is strictly below
    assert masks[0.25].tolist() == [[True, False, False, False, False]]  # tau_h = 0.2 exactly
    assert masks[0.5].tolist() == [[True, True, False, False, False]]  # tau_h = 0.3 exactly
    assert masks[1.0].tolist() == [[True, True, True, True, False]]  # tau_h = max


def test_probability_threshold_is_strict():
    at_threshold = torch.tensor(math.log(0.002), dtype=torch.float32)
    just_below = torch.nextafter(at_threshold, torch.tensor(-math.inf))
    log_probs = torch.stack([at_threshold, just_below, torch.tensor(HIGH)]).unsqueeze(0)
    entropies = row([0.0, 0.0, 0.0])
    _, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 3))
    assert stats["num_candidates"] == 1


def test_entropy_threshold_is_strict():
    # Two candidates with equal entropy: tau_h equals that entropy, and H < tau_h is false for both.
    log_probs = row([LOW, LOW])
    entropies = row([0.3, 0.3])
    spurious, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 2))
    assert stats["entropy_threshold"] == pytest.approx(0.3)
    assert spurious.sum() == 0


@pytest.mark.parametrize("advantage", [0.0, -1.0])
def test_zero_and_negative_advantages_are_never_masked(advantage):
    log_probs = torch.full((2, 4), LOW)
    entropies = torch.tensor([[0.01, 0.02, 0.03, 0.04], [0.5, 0.6, 0.7, 0.8]])
    advantages = torch.tensor([advantage, 1.0])
    spurious, stats = spurious_token_mask(log_probs, entropies, advantages, torch.ones(2, 4))
    assert not spurious[0].any()
    # The pool holds only the positive row: tau_h = 0.8-quantile of [0.5, 0.6, 0.7, 0.8] = 0.7 + 0.4 * 0.1
    assert stats["entropy_threshold"] == pytest.approx(0.74)
    assert spurious[1].tolist() == [True, True, True, False]


def test_per_token_advantages_are_accepted():
    log_probs = torch.full((1, 3), LOW)
    entropies = row([0.1, 0.2, 0.3])
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    spurious, stats = spurious_token_mask(log_probs, entropies, advantages, torch.ones(1, 3), entropy_quantile=1.0)
    assert stats["num_candidates"] == 2
    assert spurious.tolist() == [[True, False, False]]


def test_empty_pool_masks_nothing():
    log_probs = row([HIGH, HIGH, LOW])
    entropies = row([0.1, 0.1, 0.1])
    advantages = torch.tensor([-1.0])
    spurious, stats = spurious_token_mask(log_probs, entropies, advantages, torch.ones(1, 3))
    assert spurious.dtype == torch.bool and not spurious.any()
    assert stats["num_candidates"] == 0 and stats["num_spurious"] == 0
    assert math.isnan(stats["entropy_threshold"])
    assert stats["spurious_fraction"] == 0.0
    assert stats["spurious_logit_grad_sq_share_estimate"] == 0.0


def test_padding_and_tool_tokens_are_ignored():
    # Positions 3 and 4 are padding or tool output (loss_mask 0): low p, H = 0, but neither a candidate nor counted
    # in the pool. With them, tau_h would be the 0.8-quantile of [0, 0, 0.1, 0.2, 0.3] = 0.22 instead of 0.26.
    log_probs = row([LOW, LOW, LOW, LOW, LOW])
    entropies = row([0.1, 0.2, 0.3, 0.0, 0.0])
    loss_mask = torch.tensor([[1, 1, 1, 0, 0]])
    spurious, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), loss_mask)
    assert stats["entropy_threshold"] == pytest.approx(0.26)
    assert spurious.tolist() == [[True, True, False, False, False]]
    assert stats["num_tokens"] == 3
    bool_mask_result = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), loss_mask.bool())[0]
    assert torch.equal(bool_mask_result, spurious)


def test_non_finite_entropy_is_never_a_candidate():
    log_probs = row([LOW, LOW, LOW])
    entropies = row([float("nan"), 0.1, 0.2])
    spurious, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 3))
    assert stats["num_candidates"] == 2
    assert stats["entropy_threshold"] == pytest.approx(0.18)
    assert spurious.tolist() == [[False, True, False]]


def test_statistics_are_plain_python_numbers():
    log_probs = torch.tensor([[LOW, HIGH], [LOW, LOW]])
    entropies = torch.tensor([[0.1, 1.0], [0.2, 2.0]])
    _, stats = spurious_token_mask(log_probs, entropies, torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    assert set(stats) == {
        "num_tokens",
        "num_candidates",
        "num_spurious",
        "spurious_fraction",
        "entropy_threshold",
        "entropy_p50",
        "entropy_p80",
        "entropy_p99",
        "spurious_logit_grad_sq_share_estimate",
    }
    assert all(type(value) in (int, float) for value in stats.values())
    assert stats["num_tokens"] == 4
    # Percentiles over all four loss tokens [0.1, 0.2, 1.0, 2.0]
    assert stats["entropy_p50"] == pytest.approx(0.6)
    assert stats["entropy_p80"] == pytest.approx(1.0 + 0.4 * 1.0)


def test_masked_grad_share_is_hand_computable():
    # Two tokens with A = 1 and A = 2 (one per row). Row 0's token is silenced (pool of two candidates, q = 0.8).
    log_probs = torch.tensor([[LOW], [LOW]])
    entropies = torch.tensor([[0.1], [0.9]])
    advantages = torch.tensor([1.0, 2.0])
    spurious, stats = spurious_token_mask(log_probs, entropies, advantages, torch.ones(2, 1))
    assert spurious.tolist() == [[True], [False]]
    p = 0.001
    factor = [1 - 2 * p + max(p * p, math.exp(-h)) for h in (0.1, 0.9)]
    expected = 1.0 * factor[0] / (1.0 * factor[0] + 4.0 * factor[1])
    assert stats["spurious_logit_grad_sq_share_estimate"] == pytest.approx(expected, rel=1e-5)


def test_grad_norm_bound_is_below_the_exact_factor():
    torch.manual_seed(0)
    logits = torch.randn(64, 50, dtype=torch.float64) * 3
    probs = logits.softmax(-1)
    targets = torch.randint(0, 50, (64,))
    p = probs.gather(-1, targets[:, None]).squeeze(-1)
    exact = 1 - 2 * p + probs.square().sum(-1)
    entropies = -(probs * probs.log()).sum(-1)
    bound = logit_grad_sq_norm_lower_bound(p.log(), entropies)
    assert torch.all(bound <= exact + 1e-12)
    # Tight at the extremes: all mass on another token gives |e_y - pi|^2 = 2, all mass on y gives 0.
    assert logit_grad_sq_norm_lower_bound(torch.tensor([-100.0]), torch.tensor([0.0])).item() == pytest.approx(2.0)
    assert logit_grad_sq_norm_lower_bound(torch.tensor([0.0]), torch.tensor([0.0])).item() == pytest.approx(0.0)


def test_linear_quantiles_match_torch_quantile():
    torch.manual_seed(0)
    values = torch.randn(1001)
    quantiles = [0.0, 0.1, 0.5, 0.8, 0.99, 1.0]
    expected = torch.quantile(values, torch.tensor(quantiles))
    assert torch.allclose(linear_quantiles(values, quantiles), expected, rtol=0, atol=1e-6)


def test_pools_above_two_to_the_24_do_not_fail():
    size = 2**24 + 5
    values = torch.arange(size, dtype=torch.float32) / size
    with pytest.raises(RuntimeError):
        torch.quantile(values, 0.5)
    median = linear_quantiles(values[torch.randperm(size)], [0.5])[0]
    assert median.item() == pytest.approx(0.5, abs=1e-6)
    # The same through the mask: every token a candidate, so the pool has 2**24 + 5 entries.
    log_probs = torch.full((1, size), LOW)
    spurious, stats = spurious_token_mask(log_probs, values.unsqueeze(0), torch.tensor([1.0]), torch.ones(1, size))
    assert stats["num_candidates"] == size
    assert abs(stats["num_spurious"] - 0.8 * size) <= 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prob_threshold": 0.0}, "prob_threshold must be in \\(0, 1\\]"),
        ({"prob_threshold": 1.5}, "prob_threshold must be in \\(0, 1\\]"),
        ({"entropy_quantile": -0.1}, "entropy_quantile must be in \\[0, 1\\]"),
        ({"entropy_quantile": 80}, "entropy_quantile must be in \\[0, 1\\]"),
    ],
)
def test_bad_thresholds_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spurious_token_mask(row([LOW]), row([0.1]), torch.tensor([1.0]), torch.ones(1, 1), **kwargs)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="entropies must have the shape of log_probs"):
        spurious_token_mask(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages must be \\[B\\] or \\[B, T\\]"):
        spurious_token_mask(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="log_probs must be \\[B, T\\]"):
        spurious_token_mask(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6))


def test_probabilities_passed_as_log_probabilities_are_refused():
    probabilities = torch.tensor([[0.001, 0.5, 0.9]])
    with pytest.raises(ValueError, match=r"log_probs holds values above 0 \(the largest is 0.9\).*torch.log\(probs\)"):
        spurious_token_mask(probabilities, torch.ones(1, 3), torch.tensor([1.0]), torch.ones(1, 3))
    padding_only = torch.tensor([[math.log(0.001), 5.0]])  # a positive value outside the loss mask is not looked at
    spurious_token_mask(padding_only, torch.ones(1, 2), torch.tensor([1.0]), torch.tensor([[1, 0]]))
    nothing_finite = torch.tensor([[float("nan"), float("-inf")]])
    spurious_token_mask(nothing_finite, torch.ones(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    rounding = torch.tensor([[math.log(0.001), 1e-6]])  # rounding above 0 passes
    spurious_token_mask(rounding, torch.ones(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
