"""The arms of a counterfactual update (`stapo-trl counterfactual`): which loss tokens of an optimizer step are silenced
before it is applied again from the same saved state. Pure tensor functions over the step's pooled ``[N, T]`` tensors
(its micro-batches' rows concatenated), one per arm, registered by name in `ARMS`.

Every arm but ``none`` is compared with S2T's own selection of the step:

- ``none``: nothing silenced; the update TRL's GRPO loss made (the replay of a run with S2T in shadow reproduces it);
- ``s2t``: S2T at the run's ``prob_threshold`` and ``entropy_quantile`` (STAPO, Algorithm 1);
- ``s2t_low_p``: S2T at a hundredth of the run's ``prob_threshold`` (2e-5 at the paper's 0.002), nearer the paper's
  share of silenced tokens ("mostly under 0.01%");
- ``random_positive``: as many tokens as ``s2t`` silences, drawn uniformly from the positive-advantage loss tokens (it
  may share tokens with ``s2t``);
- ``lowest_p_outside_s2t``: as many tokens as ``s2t`` silences, the positive-advantage loss tokens of lowest
  probability among those ``s2t`` keeps, so that it shares no token with ``s2t``: S2T's candidates above ``tau_h``
  first, then the next least likely positive tokens. It matches ``s2t`` on the sign of the advantage and, as closely
  as the step allows, on ``p``, but not on ``H``;
- ``p_only``: every S2T candidate (a positive-advantage loss token with ``p`` below ``prob_threshold``), whatever its
  entropy: the probability-only ablation of the paper (§5, "w/o entropy"), S2T's tokens included;
- ``low_p_high_h``: the S2T candidates S2T keeps, those with entropy at or above ``tau_h``: disjoint from ``s2t``,
  selected by the same probability criterion, differing in entropy;
- ``s2t_as_many_as_low_p_high_h``: as many of S2T's tokens as ``low_p_high_h`` silences, drawn uniformly from S2T's: the
  count-matched partner of ``low_p_high_h`` (both low ``p``, one low ``H`` and one high).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core.token_rules.random_silencing import count_matched_draw
from ...core.token_rules.registry import per_token_advantages
from ...core.token_rules.s2t import spurious_token_candidates, spurious_token_mask

NONE_ARM = "none"
LOW_P_DIVISOR = 100.0
"""``s2t_low_p`` uses ``prob_threshold / LOW_P_DIVISOR``."""


@dataclass(frozen=True)
class StepTokens:
    """One optimizer step's tokens as the token rules see them, its micro-batches' rows concatenated."""

    log_probs: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def positive(self) -> torch.Tensor:
        """The loss tokens of positive-advantage responses."""
        valid = self.loss_mask.bool()
        return valid & (per_token_advantages(self.advantages.detach(), valid) > 0)


@dataclass(frozen=True)
class ArmSettings:
    """What the arms read besides the tokens: the run's S2T thresholds, the step's S2T selection (the count the
    count-matched arms match, and the tokens the disjoint arm avoids) and the generator of the random draw."""

    prob_threshold: float
    entropy_quantile: float
    s2t: torch.Tensor
    generator: torch.Generator


ArmSelection = Callable[[StepTokens, ArmSettings], torch.Tensor]


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    select: ArmSelection


def s2t_selection(tokens: StepTokens, prob_threshold: float, entropy_quantile: float) -> torch.Tensor:
    """S2T's silenced tokens of the step (`spurious_token_mask`)."""
    silenced, _ = spurious_token_mask(
        tokens.log_probs,
        tokens.entropies,
        tokens.advantages,
        tokens.loss_mask,
        prob_threshold=prob_threshold,
        entropy_quantile=entropy_quantile,
    )
    return silenced


def lowest_p_outside(tokens: StepTokens, excluded: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` positive-advantage loss tokens of lowest log-probability outside ``excluded`` (fewer when the step
    has fewer), ties broken by position."""
    pool = tokens.positive & ~excluded.bool()
    flat = pool.flatten()
    positions = flat.nonzero().squeeze(1)
    take = min(count, positions.numel())
    order = torch.sort(tokens.log_probs.detach().flatten()[positions], stable=True).indices[:take]
    chosen = torch.zeros_like(flat)
    chosen[positions[order]] = True
    return chosen.view_as(pool)


def low_p_candidates(tokens: StepTokens, prob_threshold: float) -> torch.Tensor:
    """S2T's candidates of the step (`spurious_token_candidates`): positive-advantage loss tokens with ``p`` below
    ``prob_threshold``."""
    return spurious_token_candidates(
        tokens.log_probs, tokens.entropies, tokens.advantages, tokens.loss_mask, prob_threshold=prob_threshold
    )


def _none(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return torch.zeros_like(tokens.loss_mask, dtype=torch.bool)


def _s2t(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return settings.s2t.clone()


def _s2t_low_p(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return s2t_selection(tokens, settings.prob_threshold / LOW_P_DIVISOR, settings.entropy_quantile)


def _random_positive(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    (drawn,) = count_matched_draw([tokens.positive], int(settings.s2t.sum()), settings.generator)
    return drawn


def _lowest_p_outside_s2t(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return lowest_p_outside(tokens, settings.s2t, int(settings.s2t.sum()))


def _p_only(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return low_p_candidates(tokens, settings.prob_threshold)


def _low_p_high_h(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    return low_p_candidates(tokens, settings.prob_threshold) & ~settings.s2t.bool()


def _s2t_as_many_as_low_p_high_h(tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    count = int(_low_p_high_h(tokens, settings).sum())
    (drawn,) = count_matched_draw([settings.s2t.bool()], count, settings.generator)
    return drawn


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("none", "nothing silenced: GRPO's update", _none),
        Arm("s2t", "S2T at the run's prob_threshold and entropy_quantile", _s2t),
        Arm("s2t_low_p", f"S2T at prob_threshold / {LOW_P_DIVISOR:g}", _s2t_low_p),
        Arm("random_positive", "as many positive-advantage tokens as S2T silences, drawn uniformly", _random_positive),
        Arm(
            "lowest_p_outside_s2t",
            "as many positive-advantage tokens as S2T silences, the least likely of those S2T keeps",
            _lowest_p_outside_s2t,
        ),
        Arm("p_only", "every S2T candidate (p below prob_threshold, any entropy)", _p_only),
        Arm("low_p_high_h", "the S2T candidates S2T keeps (entropy at or above tau_h)", _low_p_high_h),
        Arm(
            "s2t_as_many_as_low_p_high_h",
            "as many of S2T's tokens as low_p_high_h silences, drawn uniformly",
            _s2t_as_many_as_low_p_high_h,
        ),
    )
}
"""The arms by name, in the order they run. An arm's random draws are seeded by its position here: new arms go last."""


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
"""The comparisons `stapo-trl counterfactual` reports, first arm minus second. With the entropy change after a
generation's last step, the first is the primary comparison of the study's second plan (2026-12-05) and the second that
of its first plan (2026-11-28); both plans are in docs/records/counterfactual-updates.md."""
PRIMARY_COMPARISON = COMPARISONS[0]
FIRST_PLAN_PRIMARY_COMPARISON = COMPARISONS[1]
REFERENCE_ARM = "s2t"
"""The arm whose selection the counts of a summary describe (how many generations and tokens S2T silenced)."""


def arm_settings(config, tokens: StepTokens, generator: torch.Generator) -> ArmSettings:
    """The settings of every arm for one step of a run trained with ``config`` (a `STAPOConfig`): its S2T thresholds
    and S2T's selection among ``tokens``."""
    s2t = s2t_selection(tokens, config.prob_threshold, config.entropy_quantile)
    return ArmSettings(config.prob_threshold, config.entropy_quantile, s2t, generator)


def select_tokens(arm: str, tokens: StepTokens, settings: ArmSettings) -> torch.Tensor:
    """The loss tokens ``arm`` silences in the step (bool, shaped like ``tokens.loss_mask``)."""
    if arm not in ARMS:
        raise ValueError(f"Unknown counterfactual arm {arm!r}; choose from {', '.join(ARMS)}.")
    return ARMS[arm].select(tokens, settings) & tokens.loss_mask.bool()
