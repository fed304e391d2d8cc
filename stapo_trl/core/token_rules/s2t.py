"""S2T, the spurious-token mask of STAPO (arXiv 2602.15620, Algorithm 1), as pure tensor functions (its configuration
fields and spec are in :mod:`.s2t_rule`).

Under ``torch.distributed`` it pools candidates and counts across ranks; every rank must then call it together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from ..distributed import all_gather_variable, all_reduce_sum
from .registry import per_token_advantages, validate_token_inputs, working_dtype

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
    positive = loss_mask.bool() & (per_token_advantages(advantages.detach(), loss_mask) > 0)
    log_probs = log_probs.detach().to(working_dtype(log_probs))
    return positive & (log_probs < math.log(prob_threshold)) & torch.isfinite(entropies.detach())


def candidates_below(probability_bound: float) -> Callable[..., torch.Tensor]:
    """:func:`spurious_token_candidates` below ``probability_bound`` (a rule's `TokenRuleSpec.probability_bound`), as
    a function of ``(log_probs, entropies, advantages, loss_mask)`` alone: the gradient probe's candidate pool."""
    return partial(spurious_token_candidates, prob_threshold=probability_bound)


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

    The candidates are :func:`spurious_token_candidates` (``log p < log(prob_threshold)``, strict). ``tau_h`` is the
    ``entropy_quantile``-th quantile (linear interpolation) of their entropies, pooled over every row given here and
    over all ranks when ``torch.distributed`` is initialized; candidates strictly below ``tau_h`` are *spurious*,
    silenced. An empty pool silences nothing. Pass every micro-batch of one optimizer step at once: the paper pools
    over the mini-batch. A token with a non-finite entropy or a NaN log-probability is never a candidate but counts in
    ``num_tokens`` (docs/semantics.md).

    ``log_probs`` (natural log), ``entropies`` (nats) and ``loss_mask`` are ``[B, T]``; ``advantages`` is ``[B]`` or
    ``[B, T]``; ``prob_threshold`` is ``tau_p`` in (0, 1], ``entropy_quantile`` is ``q`` in [0, 1] (the paper's
    "tau_h = 80%" is 0.8). Returns ``(spurious, stats)``: a bool ``[B, T]`` mask, True where silenced, and global statistics:
    ``num_tokens``, ``num_candidates``, ``num_spurious``, ``spurious_fraction``, ``entropy_threshold`` (NaN for an
    empty pool), ``entropy_p50``/``p80``/``p99`` over all loss tokens, and ``spurious_logit_grad_sq_share_estimate``,
    the silenced tokens' share of ``sum_t A_t**2 (1 - 2p_t + sum_v pi_v**2)`` (a formula at the logits,
    :func:`logit_grad_sq_norm_lower_bound`, not a measured gradient).
    """
    check_s2t_thresholds(prob_threshold, entropy_quantile)
    validate_token_inputs(log_probs, entropies, advantages, loss_mask)
    check_log_probabilities(log_probs, loss_mask)

    log_probs = log_probs.detach().to(working_dtype(log_probs))
    entropies = entropies.detach().to(working_dtype(entropies))
    valid = loss_mask.bool()
    advantages = per_token_advantages(advantages.detach(), valid)

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
