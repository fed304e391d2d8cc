"""The token-rule registry: rules by name, applied in order, each seeing the tokens the rules before it kept."""

import math

import pytest
import torch

from stapo_trl.core.token_rules import (
    TOKEN_RULES,
    RuleCall,
    TokenRuleResult,
    apply_token_rules,
    get_token_rule,
    register_token_rule,
    spurious_token_mask,
)

LOW = math.log(0.001)


def test_s2t_and_stare_are_registered():
    assert {"s2t", "stare"} <= set(TOKEN_RULES)


def test_the_s2t_rule_is_the_spurious_token_mask():
    log_probs = torch.tensor([[LOW, LOW, math.log(0.5), LOW]])
    entropies = torch.tensor([[0.1, 0.9, 2.0, 0.4]])
    advantages, loss_mask = torch.tensor([1.0]), torch.ones(1, 4)
    spurious, stats = spurious_token_mask(log_probs, entropies, advantages, loss_mask)
    result = get_token_rule("s2t")(log_probs, entropies, advantages, loss_mask.bool())
    assert torch.equal(result.keep, ~spurious) and result.weights is None
    assert result.stats["num_silenced"] == stats["num_spurious"] == 2
    assert result.stats["silenced_fraction"] == stats["spurious_fraction"] == 0.5
    assert result.stats["entropy_threshold"] == stats["entropy_threshold"]


def test_stare_after_s2t_selects_among_the_kept_tokens():
    # Tokens 0 and 1 are S2T candidates (p = 0.001); tau_h = 0.1 + 0.8 * 1.9 = 1.62 silences token 0 only. STARE
    # then takes ceil(0.1 * 3) = 1 of the three kept positive tokens: token 1. Alone, it would pick the tie 0 and 1.
    log_probs = torch.tensor([[LOW, LOW, math.log(0.5), math.log(0.6)]])
    entropies = torch.tensor([[0.1, 2.0, 1.0, 1.0]])
    advantages, loss_mask = torch.tensor([1.0]), torch.ones(1, 4)
    composed = apply_token_rules([("s2t", {}), ("stare", {})], log_probs, entropies, advantages, loss_mask)
    assert composed.keep.tolist() == [[False, True, True, True]]
    assert torch.allclose(composed.weights, torch.tensor([[1.0, 1.1, 1.0, 1.0]]))
    assert composed.stats["s2t"]["num_silenced"] == 1
    assert composed.stats["stare"]["num_tokens"] == 3

    stare_alone = apply_token_rules([("stare", {})], log_probs, entropies, advantages, loss_mask)
    assert stare_alone.keep.all()
    assert torch.allclose(stare_alone.weights, torch.tensor([[1.1, 1.1, 1.0, 1.0]]))


def test_weights_of_several_rules_multiply(halving_rule):
    log_probs = torch.log(torch.tensor([[0.01, 0.5]]))
    composed = apply_token_rules(
        [("stare", {}), (halving_rule, {"factor": 0.5})],
        log_probs,
        torch.ones(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
    )
    assert torch.allclose(composed.weights, torch.tensor([[0.55, 0.5]]))
    assert composed.stats[halving_rule] == {"factor": 0.5}


@pytest.fixture
def halving_rule():
    @register_token_rule("test_scale_all")
    def scale_all(log_probs, entropies, advantages, loss_mask, *, factor):
        return TokenRuleResult(weights=torch.full_like(log_probs, factor), stats={"factor": factor})

    yield "test_scale_all"
    del TOKEN_RULES["test_scale_all"]


def test_unknown_rules_name_the_registered_ones():
    with pytest.raises(KeyError, match=r"No token rule named 'nope'. Registered rules: .*s2t, stare"):
        get_token_rule("nope")


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="'s2t' is already registered"):
        register_token_rule("s2t")(lambda *args, **kwargs: TokenRuleResult())


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        (None, TypeError, "must return a TokenRuleResult"),
        (TokenRuleResult(keep=torch.ones(1, 3, dtype=torch.bool)), ValueError, r"keep of shape \(1, 3\)"),
        (TokenRuleResult(keep=torch.ones(1, 2)), TypeError, "it must be torch.bool"),
        (TokenRuleResult(weights=torch.tensor([[1.0, -1.0]])), ValueError, "negative or not finite"),
        (TokenRuleResult(weights=torch.tensor([[1.0, float("nan")]])), ValueError, "negative or not finite"),
    ],
)
def test_a_rule_returning_something_malformed_is_named(result, error, message):
    register_token_rule("test_malformed")(lambda *args, **kwargs: result)
    try:
        with pytest.raises(error, match=message):
            apply_token_rules(
                [("test_malformed", {})], torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2)
            )
    finally:
        del TOKEN_RULES["test_malformed"]


def test_a_rule_in_shadow_is_computed_and_reported_but_not_applied():
    # S2T in shadow before STARE: STARE sees every token (nothing was dropped), S2T reports the one it would drop.
    log_probs = torch.tensor([[LOW, LOW, math.log(0.5), math.log(0.6)]])
    entropies = torch.tensor([[0.1, 2.0, 1.0, 1.0]])
    advantages, loss_mask = torch.tensor([1.0]), torch.ones(1, 4)
    composed = apply_token_rules(
        [RuleCall("s2t", {}, shadow=True), RuleCall("stare", {})], log_probs, entropies, advantages, loss_mask
    )
    assert composed.keep.all()
    assert torch.allclose(composed.weights, torch.tensor([[1.1, 1.1, 1.0, 1.0]]))
    assert set(composed.stats) == {"stare"} and composed.stats["stare"]["num_tokens"] == 4
    assert composed.shadow_stats["s2t"]["num_silenced"] == 1
    assert composed.shadow_silenced["s2t"].tolist() == [[True, False, False, False]]
