"""The S2T mask's hand-computed cases give the same masks through verl's path (verl's ``ppo_loss`` with
``loss_mode: stapo``, the paper's thresholds) as the pure function: ties, no candidates, one candidate, a response
silenced whole, negative advantages only, and padding.

The mask is read off verl's path as the tokens whose loss gradient is exactly 0 (every loss token here has a
non-zero advantage, so only a silenced token has none). Each case runs on the v0 trainer's padded batch and on the v1
trainer's nested one.
"""

import math

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
from verl_loss_calls import metric, verl_loss  # noqa: E402

from stapo_trl import spurious_token_mask  # noqa: E402
from stapo_trl.verl.actor_batch import LAYOUTS  # noqa: E402

LOW, HIGH = math.log(0.001), math.log(0.5)


def case(log_probs, entropies, advantages, response_mask=None):
    log_probs = torch.tensor(log_probs, dtype=torch.float64)
    entropies = torch.tensor(entropies, dtype=torch.float64)
    response_mask = (
        torch.ones_like(log_probs, dtype=torch.long) if response_mask is None else torch.tensor(response_mask)
    )
    return log_probs, entropies, advantages, response_mask


CASES = {
    # Five candidates with H = 0.1 ... 0.5: tau_h = 0.4 + 0.2 * 0.1 = 0.42, four silenced.
    "lowest entropy share": (case([[LOW] * 5], [[0.5, 0.1, 0.4, 0.2, 0.3]], [1.0]), [[0, 1, 1, 1, 1]], 0.42),
    # Equal entropies: tau_h is that entropy and none is strictly below.
    "ties": (case([[LOW, LOW, LOW]], [[0.3, 0.3, 0.3]], [1.0]), [[0, 0, 0]], 0.3),
    "no candidates": (case([[HIGH, HIGH, HIGH]], [[0.1, 0.2, 0.3]], [1.0]), [[0, 0, 0]], None),
    # One candidate: tau_h is its own entropy, so it is kept.
    "one candidate": (case([[LOW, HIGH, HIGH]], [[0.1, 0.2, 0.3]], [1.0]), [[0, 0, 0]], 0.1),
    # Row 0's three candidates lie below tau_h = 0.8-quantile of [0.1, 0.2, 0.3, 0.9] = 0.3 + 0.4 * 0.6 = 0.54: silenced whole.
    "a response silenced whole": (
        case([[LOW, LOW, LOW], [LOW, HIGH, HIGH]], [[0.1, 0.2, 0.3], [0.9, 0.1, 0.1]], [1.0, 2.0]),
        [[1, 1, 1], [0, 0, 0]],
        0.54,
    ),
    "negative advantages only": (
        case([[LOW, LOW], [LOW, LOW]], [[0.1, 0.2], [0.3, 0.4]], [-1.0, -0.5]),
        [[0, 0], [0, 0]],
        None,
    ),
    # Positions 3 and 4 are padding: tau_h = 0.8-quantile of [0.1, 0.2, 0.3] = 0.26, not 0.22 as with them.
    "padding": (
        case([[LOW] * 5], [[0.1, 0.2, 0.3, 0.0, 0.0]], [1.0], [[1, 1, 1, 0, 0]]),
        [[1, 1, 0, 0, 0]],
        0.26,
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_hand_case_through_verl(name, loss_agg_mode, layout):
    (log_probs, entropies, advantages, response_mask), expected, tau_h = CASES[name]
    expected = torch.tensor(expected, dtype=torch.bool)
    pure, stats = spurious_token_mask(log_probs, entropies, torch.tensor(advantages), response_mask)
    assert torch.equal(pure, expected)

    (loss,), gradient, (metrics,) = verl_loss(
        log_probs, entropies, advantages, response_mask, "stapo", loss_agg_mode, layout=layout
    )
    through_verl = (gradient == 0) & response_mask.bool()
    assert torch.equal(through_verl, expected)
    assert metric(metrics, "actor/s2t/num_silenced") == int(expected.sum())
    assert metric(metrics, "actor/s2t/num_candidates") == stats["num_candidates"]
    if tau_h is None:
        assert metric(metrics, "actor/s2t/entropy_threshold") is None
    else:
        assert metric(metrics, "actor/s2t/entropy_threshold") == pytest.approx(tau_h)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_response_silenced_whole_still_counts_among_the_sequences(layout):
    """Under seq-mean-token-mean, as under TRL's grpo loss, the silenced response contributes 0 and still counts:
    the loss is (0 + mean(-A over row 1's three tokens)) / 2 at ratio 1."""
    (log_probs, entropies, advantages, response_mask), _, _ = CASES["a response silenced whole"]
    (loss,), _, _ = verl_loss(
        log_probs, entropies, advantages, response_mask, "stapo", "seq-mean-token-mean", layout=layout
    )
    assert loss.item() == pytest.approx((0.0 - 2.0) / 2, abs=1e-6)
