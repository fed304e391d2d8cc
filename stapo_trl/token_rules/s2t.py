"""S2T, the spurious-token mask of STAPO (arXiv 2602.15620, Algorithm 1), its configuration fields, and its spec,
registered as ``"s2t"``.

Under ``torch.distributed`` it pools candidates and counts across ranks; every rank must then call it together.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..distributed import all_gather_variable, all_reduce_sum
from .registry import (
    RuleMethod,
    RuleReport,
    TokenRuleResult,
    TokenRuleSpec,
    register_token_rule_spec,
    rule_metric,
    validate_token_inputs,
    working_dtype,
)

ENTROPY_PERCENTILES = (0.5, 0.8, 0.99)


def linear_quantiles(values: torch.Tensor, quantiles: Sequence[float]) -> torch.Tensor:
    """Quantiles of a 1-D tensor with linear interpolation, as ``torch.quantile(..., interpolation="linear")``.

    ``torch.quantile`` refuses inputs above 2**24 elements; this sorts once and interpolates, so it has no size
    limit and serves several quantiles from one sort.
    """
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"linear_quantiles needs a non-empty 1-D tensor, got shape {tuple(values.shape)}.")
    ordered = values.sort().values
    last = ordered.numel() - 1
    positions = torch.tensor([q * last for q in quantiles], dtype=torch.float64, device=values.device)
    below = positions.floor().long()
    above = torch.clamp(below + 1, max=last)
    weights = (positions - below).to(ordered.dtype)
    return torch.lerp(ordered[below], ordered[above], weights)


def logit_grad_sq_norm_lower_bound(log_probs: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
    """Lower bound on ``1 - 2p + sum_v pi_v**2``, the squared norm of d log p / d logits (STAPO §3).

    The exact factor needs ``sum_v pi_v**2``, which fused heads do not return. Since the Rényi-2 entropy never exceeds
    the Shannon entropy, ``sum_v pi_v**2 >= exp(-H)``, and trivially ``>= p**2``. The bound is tight for the peaked,
    low-entropy distributions that S2T targets.
    """
    probs = log_probs.exp()
    sum_sq_probs = torch.maximum(probs.square(), torch.exp(-entropies))
    return (1 - 2 * probs + sum_sq_probs).clamp(min=0)


POSITIVE_LOG_PROB_TOLERANCE = 1e-3
"""A log-probability is at most 0; fused kernels can overshoot by rounding, far less than this."""


def check_log_probabilities(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Refuse ``log_probs`` above 0 among the loss tokens: probabilities passed instead of log-probabilities would
    otherwise silence nothing, without a word."""
    counted = log_probs.detach()[loss_mask.bool()]
    counted = counted[torch.isfinite(counted)]
    largest = counted.max() if counted.numel() else None
    if largest is not None and float(largest) > POSITIVE_LOG_PROB_TOLERANCE:
        raise ValueError(
            f"log_probs holds values above 0 (the largest is {float(largest):.4g}), which no log-probability can be. "
            "Pass natural-log probabilities, for example torch.log(probs), not probabilities."
        )


def spurious_token_candidates(
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    prob_threshold: float = 0.002,
) -> torch.Tensor:
    """S2T's candidates (step 1 of Algorithm 1): loss tokens of a positive-advantage response whose probability is
    strictly below ``prob_threshold`` and whose entropy is finite. Shapes as for :func:`spurious_token_mask`; returns
    a bool ``[B, T]`` tensor. It reads only this rank's rows."""
    advantages = advantages.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_probs = log_probs.detach().to(working_dtype(log_probs))
    finite_entropy = torch.isfinite(entropies.detach())
    return loss_mask.bool() & (advantages > 0) & (log_probs < math.log(prob_threshold)) & finite_entropy


def spurious_token_mask(
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    prob_threshold: float = 0.002,
    entropy_quantile: float = 0.8,
) -> tuple[torch.Tensor, dict[str, float | int]]:
    """The S2T (silencing spurious tokens) mask of STAPO, Algorithm 1 (arXiv 2602.15620).

    A token that counts in the loss is a *candidate* when its response has a positive advantage and its probability
    is below ``prob_threshold`` (``log p < log(prob_threshold)``, strict). ``tau_h`` is the ``entropy_quantile``-th
    quantile (linear interpolation) of the candidates' entropies, pooled over every row given here and over all
    ranks when ``torch.distributed`` is initialized. A candidate is *spurious* when its entropy is strictly below
    ``tau_h``: the lowest-entropy share of the low-probability positive tokens is silenced. An empty pool silences
    nothing.

    Non-finite statistics (from degenerate or overflowing logits) are a defined case. A token whose entropy is NaN or
    infinite, or whose log-probability is NaN, is never a candidate: it is never silenced and never in the ``tau_h``
    pool, but it counts in ``num_tokens``. Non-finite entropies are left out of the entropy percentiles, and tokens
    whose factor ``A**2 (1 - 2p + sum_v pi_v**2)`` is not finite are left out of ``spurious_logit_grad_sq_share_estimate``.
    ``log p = -inf`` is ``p = 0``, an ordinary value.

    Pass every micro-batch that feeds one optimizer step at once (concatenated along B): the paper pools over the
    mini-batch, not the micro-batch.

    Args:
        log_probs: ``[B, T]`` natural-log probability of each sampled token.
        entropies: ``[B, T]`` Shannon entropy, in nats, of each position's next-token distribution.
        advantages: ``[B]`` or ``[B, T]`` advantages.
        loss_mask: ``[B, T]``, bool or 0/1: the tokens that count in the loss.
        prob_threshold: ``tau_p``, an absolute probability in (0, 1].
        entropy_quantile: ``q`` in [0, 1]; the paper's "tau_h = 80%" is 0.8.

    Returns:
        ``(spurious, stats)``: a bool ``[B, T]`` tensor, True where the token is silenced, and global statistics:
        ``num_tokens``, ``num_candidates``, ``num_spurious``, ``spurious_fraction``, ``entropy_threshold`` (NaN when
        the pool is empty), ``entropy_p50``/``p80``/``p99`` over all loss tokens, and ``spurious_logit_grad_sq_share_estimate``: the
        share of ``sum_t A_t**2 (1 - 2p_t + sum_v pi_v**2)`` (the squared logit-gradient norm at ratio 1) that the
        silenced tokens carry, with ``sum_v pi_v**2`` estimated by :func:`logit_grad_sq_norm_lower_bound`. That
        share is a formula evaluated at the logits, not a measured gradient of the model's weights.
    """
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(f"prob_threshold must be in (0, 1], got {prob_threshold}.")
    if not 0.0 <= entropy_quantile <= 1.0:
        raise ValueError(f"entropy_quantile must be in [0, 1], got {entropy_quantile}.")
    validate_token_inputs(log_probs, entropies, advantages, loss_mask)
    check_log_probabilities(log_probs, loss_mask)

    log_probs = log_probs.detach().to(working_dtype(log_probs))
    entropies = entropies.detach().to(working_dtype(entropies))
    advantages = advantages.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    valid = loss_mask.bool()

    candidates = spurious_token_candidates(log_probs, entropies, advantages, valid, prob_threshold=prob_threshold)
    pool = all_gather_variable(entropies[candidates])
    if pool.numel() > 0:
        entropy_threshold = linear_quantiles(pool, [entropy_quantile])[0]
        spurious = candidates & (entropies < entropy_threshold)
        threshold_value = float(entropy_threshold)
    else:
        spurious = torch.zeros_like(candidates)
        threshold_value = float("nan")

    grad_factor = advantages.double().square() * logit_grad_sq_norm_lower_bound(log_probs, entropies).double()
    grad_factor = torch.where(valid & torch.isfinite(grad_factor), grad_factor, torch.zeros_like(grad_factor))
    totals = all_reduce_sum(
        torch.stack(
            [
                valid.sum().double(),
                candidates.sum().double(),
                spurious.sum().double(),
                grad_factor.sum(),
                grad_factor[spurious].sum(),
            ]
        )
    ).tolist()
    num_tokens, num_candidates, num_spurious = (int(count) for count in totals[:3])
    grad_total, grad_spurious = totals[3], totals[4]

    token_entropies = all_gather_variable(entropies[valid & torch.isfinite(entropies)])
    if token_entropies.numel() > 0:
        percentiles = linear_quantiles(token_entropies, ENTROPY_PERCENTILES).tolist()
    else:
        percentiles = [float("nan")] * len(ENTROPY_PERCENTILES)

    stats = {
        "num_tokens": num_tokens,
        "num_candidates": num_candidates,
        "num_spurious": num_spurious,
        "spurious_fraction": num_spurious / num_tokens if num_tokens else 0.0,
        "entropy_threshold": threshold_value,
        **{f"entropy_p{round(q * 100)}": value for q, value in zip(ENTROPY_PERCENTILES, percentiles, strict=True)},
        "spurious_logit_grad_sq_share_estimate": grad_spurious / grad_total if grad_total > 0 else 0.0,
    }
    return spurious, stats


S2T_SILENCED_FRACTION = rule_metric("s2t", "silenced_fraction")
S2T_NUM_SILENCED = rule_metric("s2t", "num_silenced")
S2T_NUM_CANDIDATES = rule_metric("s2t", "num_candidates")
S2T_ENTROPY_THRESHOLD = rule_metric("s2t", "entropy_threshold")
S2T_LOGIT_GRAD_SQ_SHARE = rule_metric("s2t", "logit_grad_sq_share_estimate")


@dataclass
class S2TConfigMixin:
    r"""
    The parameters of the S2T (silencing spurious tokens) mask of STAPO.

    Parameters:
        use_s2t_mask (`bool`, *optional*, defaults to `True`):
            Silence spurious tokens and renormalize the loss over the kept ones (under `dr_grpo` and `luspo`, whose
            denominators count no tokens, silenced tokens only leave the numerator). With `False`, training is
            exactly GRPO.
        prob_threshold (`float`, *optional*, defaults to `0.002`):
            `tau_p`: a token of a positive-advantage response is a candidate when its probability is below this.
        entropy_quantile (`float`, *optional*, defaults to `0.8`):
            `q`: candidates whose entropy is below the `q`-quantile of the candidates' entropies (pooled over the
            whole optimizer step, across processes) are silenced. The paper's "tau_h = 80%".
    """

    use_s2t_mask: bool = field(
        default=True,
        metadata={
            "help": "Silence spurious tokens (S2T) and renormalize the loss over the kept tokens (under dr_grpo and "
            "luspo, whose denominators count no tokens, silenced tokens only leave the numerator). With `False`, "
            "training is exactly GRPO."
        },
    )
    prob_threshold: float = field(
        default=0.002,
        metadata={
            "help": "tau_p, in (0, 1]: a token of a positive-advantage response is a spurious-token candidate when its "
            "probability under the policy is strictly below this value. The paper uses 0.002."
        },
    )
    entropy_quantile: float = field(
        default=0.8,
        metadata={
            "help": "q, in [0, 1]: tau_h is the q-quantile of the candidates' entropies over the whole optimizer step "
            "(all micro-batches and processes); candidates strictly below tau_h are silenced. The paper's "
            "'tau_h = 80 percent' is 0.8 (the later revision uses 0.75)."
        },
    )


def check_s2t_thresholds(prob_threshold: float, entropy_quantile: float) -> None:
    """Raise a ValueError, saying what to change, when a threshold is out of range."""
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(
            f"prob_threshold must be in (0, 1], got {prob_threshold}. It is an absolute probability: the paper uses "
            "0.002."
        )
    if not 0.0 <= entropy_quantile <= 1.0:
        raise ValueError(
            f"entropy_quantile must be in [0, 1], got {entropy_quantile}. It is a fraction, not a percent: the "
            "paper's 'tau_h = 80%' is entropy_quantile=0.8."
        )


class S2TRule(TokenRuleSpec):
    """The S2T mask as a token rule: keep every token that is not spurious; no weights."""

    name = "s2t"
    title = "S2T"
    switch = "use_s2t_mask"
    config_mixin = S2TConfigMixin
    order = 10
    method = RuleMethod(
        "stapo",
        "STAPO",
        "GRPO/DAPO plus the S2T mask: silence low-probability, low-entropy tokens of positive-advantage responses and "
        "renormalize the loss over the kept tokens",
    )
    report = RuleReport(
        threshold_statistic="entropy_threshold",
        threshold_title="tau_h: entropy quantile of the candidates (nats)",
        threshold_name="tau_h",
        candidates_statistic="num_candidates",
        probability_bound_field="prob_threshold",
    )
    help_title = "S2T mask (STAPO)"
    help_options = (
        ("use_s2t_mask", "silence spurious tokens and renormalize the loss over the kept ones"),
        ("prob_threshold", "tau_p: candidates have p below this (paper: 0.002)"),
        ("entropy_quantile", "tau_h is this quantile of the candidates' entropies (paper: 0.8)"),
    )

    def apply(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        spurious, stats = spurious_token_mask(log_probs, entropies, advantages, loss_mask, **params)
        logged = {
            "silenced_fraction": stats["spurious_fraction"],
            "num_silenced": stats["num_spurious"],
            "num_candidates": stats["num_candidates"],
            "entropy_threshold": stats["entropy_threshold"],
            "entropy_p50": stats["entropy_p50"],
            "entropy_p80": stats["entropy_p80"],
            "entropy_p99": stats["entropy_p99"],
            "logit_grad_sq_share_estimate": stats["spurious_logit_grad_sq_share_estimate"],
        }
        return TokenRuleResult(keep=~spurious, stats=logged)

    def validate(self, config: Any, used: bool) -> None:
        check_s2t_thresholds(config.prob_threshold, config.entropy_quantile)
        if self.is_on(config) and config.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_s2t_mask=True conflicts with top_entropy_quantile={config.top_entropy_quantile}: both select "
                "tokens by entropy, in opposite directions (20-Entropy keeps only the highest-entropy tokens without "
                "renormalizing; S2T silences the lowest-entropy low-probability positive tokens). Run one method: "
                "set top_entropy_quantile=1.0 for STAPO, or use_s2t_mask=False for 20-Entropy."
            )

    def params(self, config, step, controller) -> dict[str, Any]:
        return {"prob_threshold": config.prob_threshold, "entropy_quantile": config.entropy_quantile}

    def candidate_pool(self, config):
        return partial(spurious_token_candidates, prob_threshold=config.prob_threshold)

    def describe(self, config) -> str:
        return f"S2T on: prob_threshold {config.prob_threshold}, entropy_quantile {config.entropy_quantile}"

    def card_settings(self, config) -> list[tuple[str, str]]:
        return [
            ("prob_threshold", "tau_p: candidates have p below"),
            ("entropy_quantile", "q: tau_h is this quantile of the candidates' entropies"),
        ]

    def card_statistics(self, steps: list[dict[str, Any]]) -> list[str]:
        silenced = _logged(steps, S2T_SILENCED_FRACTION)
        thresholds = _logged(steps, S2T_ENTROPY_THRESHOLD)
        lines = []
        if silenced:
            lines.append(
                f"- S2T silenced {int(sum(_logged(steps, S2T_NUM_SILENCED)))} tokens of "
                f"{int(sum(_logged(steps, S2T_NUM_CANDIDATES)))} candidates; mean silenced fraction "
                f"{sum(silenced) / len(silenced):.4%} of loss tokens, last step {silenced[-1]:.4%} (the paper reports "
                "mostly under 0.01%)."
            )
        lines.append(
            f"- tau_h: median {statistics.median(thresholds):.3f} nats, last {thresholds[-1]:.3f}."
            if thresholds
            else "- tau_h: no step had a candidate token, so no entropy threshold was computed."
        )
        return lines

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        logged = [record for record in records if record.get(S2T_SILENCED_FRACTION) is not None]
        if not logged:
            return {}
        return {
            "silenced_tokens": int(sum(record.get(S2T_NUM_SILENCED, 0) for record in logged)),
            "candidates": int(sum(record.get(S2T_NUM_CANDIDATES, 0) for record in logged)),
            "silenced_steps": sum(1 for record in logged if record.get(S2T_NUM_SILENCED, 0) > 0),
            "silenced_fraction": sum(record[S2T_SILENCED_FRACTION] for record in logged) / len(logged),
        }

    def summary_lines(self, summary: dict[str, Any], steps: int) -> list[str]:
        return [
            f"S2T silenced:             {summary['silenced_tokens']} of {summary['candidates']} candidate tokens, in "
            f"{summary['silenced_steps']} of {steps} steps ({100 * summary['silenced_fraction']:.3f}% of loss tokens)"
        ]

    def step_line(self, logs: dict[str, Any]) -> list[str]:
        parts = []
        if S2T_SILENCED_FRACTION in logs:
            silenced = logs[S2T_SILENCED_FRACTION]
            parts.append(f"silenced {100 * silenced:.3f}% ({int(logs.get(S2T_NUM_SILENCED, 0))} tok)")
        threshold = logs.get(S2T_ENTROPY_THRESHOLD)
        if threshold is not None and math.isfinite(threshold):
            parts.append(f"tau_h {threshold:.3f}")
        return parts


def _logged(records: list[dict[str, Any]], key: str) -> list[float]:
    """The finite values of ``key`` over ``records``."""
    return [
        record[key]
        for record in records
        if isinstance(record.get(key), int | float)
        and not isinstance(record.get(key), bool)
        and math.isfinite(record[key])
    ]


register_token_rule_spec(S2TRule())
