"""RANDOM silencing, the control for S2T (``"random_silencing"``): each optimizer step silences as many
positive-advantage loss tokens as S2T would, drawn uniformly (per process, from its own rows), with the loss
renormalized as with S2T. Its generator is seeded from the run's seed, the step and the process, so torch's global
stream is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed import all_reduce_sum
from .registry import (
    MEAN,
    SUM,
    RuleMethod,
    RuleMetric,
    RulePresentation,
    RuleSetting,
    TokenRuleResult,
    TokenRuleSpec,
    per_token_advantages,
    register_token_rule_spec,
    validate_token_inputs,
)
from .s2t import check_s2t_thresholds, spurious_token_mask


def count_matched_draw(pools: list[torch.Tensor], count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Draw ``min(count, tokens in the pools)`` tokens uniformly without replacement from the union of ``pools`` (bool
    masks, one per micro-batch, any shapes), and return the drawn tokens as masks shaped like the pools."""
    flat = torch.cat([pool.flatten() for pool in pools]) if pools else torch.zeros(0, dtype=torch.bool)
    positions = flat.nonzero().squeeze(1)
    take = min(count, positions.numel())
    order = torch.randperm(positions.numel(), generator=generator)[:take].to(positions.device)
    drawn = torch.zeros_like(flat)
    drawn[positions[order]] = True
    return [part.view_as(pool) for part, pool in zip(drawn.split([p.numel() for p in pools]), pools, strict=True)]


def random_silencing_mask(
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    prob_threshold: float = 0.002,
    entropy_quantile: float = 0.8,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float | int]]:
    """Silence, uniformly at random among the positive-advantage loss tokens, as many tokens as
    :func:`~stapo_trl.core.token_rules.spurious_token_mask` would silence with the same inputs and thresholds. ``seed``
    seeds the draw's own generator.

    Returns ``(silenced, stats)``: a bool ``[B, T]`` mask of the drawn tokens, and global statistics: ``num_tokens``,
    ``num_positive`` (positive-advantage loss tokens), ``num_silenced`` (equal to S2T's count, unless a process has
    fewer positive tokens than that), ``silenced_fraction`` and ``num_also_spurious`` (drawn tokens that S2T would
    have silenced too).
    """
    validate_token_inputs(log_probs, entropies, advantages, loss_mask)
    spurious, _ = spurious_token_mask(
        log_probs, entropies, advantages, loss_mask, prob_threshold=prob_threshold, entropy_quantile=entropy_quantile
    )
    valid = loss_mask.bool()
    positive = valid & (per_token_advantages(advantages.detach(), valid) > 0)
    (silenced,) = count_matched_draw([positive], int(spurious.sum()), torch.Generator().manual_seed(seed))
    totals = all_reduce_sum(
        torch.stack([valid.sum(), positive.sum(), silenced.sum(), (silenced & spurious).sum()]).double()
    )
    num_tokens, num_positive, num_silenced, overlap = (int(value) for value in totals.tolist())
    stats = {
        "num_tokens": num_tokens,
        "num_positive": num_positive,
        "num_silenced": num_silenced,
        "silenced_fraction": num_silenced / num_tokens if num_tokens else 0.0,
        "num_also_spurious": overlap,
    }
    return silenced, stats


@dataclass
class RandomSilencingConfigMixin:
    """The switch of RANDOM silencing, the control for S2T; its help metadata says what it does."""

    use_random_silencing: bool = field(
        default=False,
        metadata={
            "help": "The control for S2T: at each optimizer step silence as many positive-advantage loss tokens as "
            "S2T would (with prob_threshold and entropy_quantile), drawn uniformly at random, and renormalize the "
            "loss over the kept tokens. Needs use_s2t_mask=False."
        },
    )


class RandomSilencingRule(TokenRuleSpec):
    """RANDOM silencing as a token rule: drops the drawn tokens; no weights."""

    name = "random_silencing"
    title = "RANDOM"
    switch = "use_random_silencing"
    config_mixin = RandomSilencingConfigMixin
    order = 30
    reads_fields = ("prob_threshold", "entropy_quantile")
    method = RuleMethod(
        "random",
        "RANDOM",
        "GRPO/DAPO with as many positive-advantage tokens silenced as S2T would silence, drawn uniformly at random, "
        "and the loss renormalized over the kept tokens: the control for STAPO",
    )
    metrics = (
        RuleMetric(
            "num_silenced",
            "tokens drawn and silenced: as many as S2T would have silenced in the step",
            "tokens",
            (("silenced_tokens", SUM),),
        ),
        RuleMetric(
            "silenced_fraction",
            "silenced tokens / loss tokens of the step",
            "share of loss tokens",
            (("silenced_fraction", MEAN),),
        ),
        RuleMetric("num_positive", "the positive-advantage loss tokens they were drawn from", "tokens"),
        RuleMetric("num_tokens", "the loss tokens of the step", "tokens"),
        RuleMetric(
            "num_also_spurious", "drawn tokens that S2T would have silenced too", "tokens", (("also_spurious", SUM),)
        ),
    )
    presentation = RulePresentation(
        step=("random-silenced {silenced_fraction:.3%} ({num_silenced:d} tok)",),
        summary_label="RANDOM silenced",
        summary="{silenced_tokens} tokens ({silenced_fraction:.3%} of loss tokens), {also_spurious} of them spurious "
        "by S2T",
        settings=(
            RuleSetting("prob_threshold", "S2T's tau_p, which sets how many tokens are drawn"),
            RuleSetting("entropy_quantile", "S2T's q, which sets how many tokens are drawn"),
        ),
    )

    def __call__(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        silenced, stats = random_silencing_mask(log_probs, entropies, advantages, loss_mask, **params)
        return TokenRuleResult(keep=~silenced, stats=stats)

    def validate(self, config: Any, used: bool) -> None:
        if not used:
            return
        check_s2t_thresholds(config.prob_threshold, config.entropy_quantile)
        if self.is_on(config) and config.use_s2t_mask:
            raise ValueError(
                "use_random_silencing=True is the control for S2T and runs instead of it: set use_s2t_mask=False "
                "(method: random does both). To log what S2T would silence in the same run, add "
                "shadow_token_rules: [s2t]."
            )

    def params(self, config: Any, step, controller) -> dict[str, Any]:
        return {
            "prob_threshold": config.prob_threshold,
            "entropy_quantile": config.entropy_quantile,
            "seed": (config.seed * 1_000_003 + step.global_step) * 1_009 + step.process_index,
        }

    def describe(self, config: Any) -> str:
        return (
            f"RANDOM silencing on: as many positive-advantage tokens as S2T would silence at prob_threshold "
            f"{config.prob_threshold}, entropy_quantile {config.entropy_quantile}, drawn uniformly"
        )


register_token_rule_spec(RandomSilencingRule())
