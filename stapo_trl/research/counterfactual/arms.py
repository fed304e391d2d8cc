"""The arms of a counterfactual update (`stapo-trl counterfactual`): which loss tokens of an optimizer step are
silenced before it is applied again from the same saved state, one function per arm over the step's pooled ``[N, T]``
tensors (docs/counterfactual.md describes each; ``p_only`` selects by probability alone)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core.token_rules import StepTokens
from ...core.token_rules.random_silencing import count_matched_draw
from ...core.token_rules.s2t import spurious_token_candidates, spurious_token_mask

NONE_ARM = "none"
LOW_P_DIVISOR = 100.0  # s2t_low_p's threshold is prob_threshold / 100: nearer the paper's "mostly under 0.01%"


@dataclass(frozen=True)
class ArmSettings:
    """What the arms read besides the tokens: the run's S2T thresholds, the step's S2T selection, a generator."""

    prob_threshold: float
    entropy_quantile: float
    s2t: torch.Tensor
    generator: torch.Generator


def s2t_selection(tokens: StepTokens, prob_threshold: float, entropy_quantile: float) -> torch.Tensor:
    """S2T's silenced tokens of the step (`spurious_token_mask`)."""
    arguments = (tokens.log_probs, tokens.entropies, tokens.advantages, tokens.loss_mask)
    return spurious_token_mask(*arguments, prob_threshold=prob_threshold, entropy_quantile=entropy_quantile)[0]


def low_p_candidates(tokens: StepTokens, prob_threshold: float) -> torch.Tensor:
    """S2T's candidates: positive-advantage loss tokens with ``p`` below ``prob_threshold``."""
    arguments = (tokens.log_probs, tokens.entropies, tokens.advantages, tokens.loss_mask)
    return spurious_token_candidates(*arguments, prob_threshold=prob_threshold)


def lowest_p_outside(tokens: StepTokens, excluded: torch.Tensor, count: int) -> torch.Tensor:
    """At most ``count`` positive-advantage loss tokens of lowest log-probability outside ``excluded``, by position."""
    pool = tokens.positive & ~excluded.bool()
    flat = pool.flatten()
    positions = flat.nonzero().squeeze(1)
    take = min(count, positions.numel())
    order = torch.sort(tokens.log_probs.detach().flatten()[positions], stable=True).indices[:take]
    chosen = torch.zeros_like(flat)
    chosen[positions[order]] = True
    return chosen.view_as(pool)


def _low_p_high_h(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return low_p_candidates(tokens, settings.prob_threshold) & ~settings.s2t.bool()


def _count_matched(pool: torch.Tensor, count: int, settings: ArmSettings) -> torch.Tensor:
    return count_matched_draw([pool], count, settings.generator)[0]


ARMS: dict[str, Callable[[StepTokens, ArmSettings], torch.Tensor]] = {
    "none": lambda tokens, settings: torch.zeros_like(tokens.loss_mask, dtype=torch.bool),
    "s2t": lambda tokens, settings: settings.s2t.clone(),
    "s2t_low_p": lambda tokens, settings: s2t_selection(
        tokens, settings.prob_threshold / LOW_P_DIVISOR, settings.entropy_quantile
    ),
    "random_positive": lambda tokens, settings: _count_matched(tokens.positive, int(settings.s2t.sum()), settings),
    "lowest_p_outside_s2t": lambda tokens, settings: lowest_p_outside(tokens, settings.s2t, int(settings.s2t.sum())),
    "p_only": lambda tokens, settings: low_p_candidates(tokens, settings.prob_threshold),
    "low_p_high_h": _low_p_high_h,
    "s2t_as_many_as_low_p_high_h": lambda tokens, settings: _count_matched(
        settings.s2t.bool(), int(_low_p_high_h(tokens, settings).sum()), settings
    ),
}
"""Each arm's selection, by name, in the order they run. An arm's random draws are seeded by its position here: new
arms go last."""

COMPARISONS = (
    ("s2t_as_many_as_low_p_high_h", "low_p_high_h"),
    ("s2t", "lowest_p_outside_s2t"),
    ("s2t", "random_positive"),
    ("s2t", "none"),
    ("lowest_p_outside_s2t", "none"),
    ("random_positive", "none"),
    ("s2t_low_p", "none"),
    ("p_only", "none"),
    ("p_only", "s2t"),
    ("low_p_high_h", "none"),
    ("s2t_as_many_as_low_p_high_h", "none"),
)
"""The comparisons `stapo-trl counterfactual` reports, first arm minus second. The first is the primary comparison of
the study's second plan, the second that of its first (docs/records/counterfactual-updates.md)."""
PRIMARY_COMPARISON, FIRST_PLAN_PRIMARY_COMPARISON = COMPARISONS[:2]
REFERENCE_ARM = "s2t"  # the arm whose selection a summary's counts describe


def arm_settings(config, tokens: StepTokens, generator: torch.Generator) -> ArmSettings:
    """Every arm's settings for one step of a run trained with ``config`` (a `STAPOConfig`)."""
    s2t = s2t_selection(tokens, config.prob_threshold, config.entropy_quantile)
    return ArmSettings(config.prob_threshold, config.entropy_quantile, s2t, generator)


def select_tokens(arm: str, tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    """The loss tokens ``arm`` silences in the step (bool, shaped like ``tokens.loss_mask``)."""
    if arm not in ARMS:
        raise ValueError(f"Unknown counterfactual arm {arm!r}; choose from {', '.join(ARMS)}.")
    return ARMS[arm](tokens, settings) & tokens.loss_mask.bool()
