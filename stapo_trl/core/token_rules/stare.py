"""STARE: surprisal-guided token-level advantage reweighting (Luo et al., 2026, arXiv 2606.19236, §4.1-4.2;
docs/semantics.md). A token is selected when its surprisal is at least the k-th largest of its pool, ``k = ceil(P *
|T|)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..distributed import all_gather_variable, all_reduce_sum
from .registry import per_token_advantages, validate_token_inputs, working_dtype

STARE_VARIANTS = ("O1", "C2")


def top_share_mask(
    values: torch.Tensor,
    candidates: torch.Tensor,
    share: float,
    *,
    groups: torch.Tensor | None = None,
    across_processes: bool = True,
) -> torch.Tensor:
    """Select the ``ceil(share * n)`` largest ``values`` among the ``n`` candidates of each pool, ties included.

    Args:
        values: ``[B, T]`` scores; NaN scores are never selected.
        candidates: ``[B, T]`` bool, the tokens that may be selected.
        share: in (0, 1].
        groups: optional ``[B]`` integer ids; each id's rows form a separate pool (one pool when None).
        across_processes: pool over all ranks of ``torch.distributed`` (every rank must call). Needs ``groups=None``.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}.")
    if groups is not None and across_processes:
        raise ValueError("Separate pools (groups) are local to a process: pass across_processes=False with groups.")
    candidates = candidates & ~torch.isnan(values)
    selected = torch.zeros_like(candidates)
    if groups is None:
        pools = [candidates]
    else:
        pools = [candidates & (groups == group).unsqueeze(1) for group in torch.unique(groups).tolist()]
    for pool_mask in pools:
        pool = values[pool_mask]
        if across_processes:
            pool = all_gather_variable(pool)
        if pool.numel() == 0:
            continue
        # The 1e-9 keeps a float product such as 0.1 * 30 = 3.0000000000000004 from rounding up to 4.
        k = min(pool.numel(), max(1, math.ceil(share * pool.numel() - 1e-9)))
        threshold = pool.topk(k).values[-1]
        selected |= pool_mask & (values >= threshold)
    return selected


class STAREWeights(NamedTuple):
    weights: torch.Tensor
    selected_positive: torch.Tensor
    selected_negative: torch.Tensor
    stats: dict[str, float | int]


def stare_token_weights(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    variant: str = "O1",
    top_surprisal_share: float = 0.1,
    positive_weight: float = 1.1,
    negative_weight: float = 0.9,
    gate_on: bool = True,
    groups: torch.Tensor | None = None,
    across_processes: bool = True,
    reduce_statistics: bool | None = None,
) -> STAREWeights:
    """STARE's per-token advantage weights (arXiv 2606.19236, Algorithm 1, stages 2-4).

    Args:
        log_probs: ``[B, T]`` natural-log probability of each sampled token; surprisal is ``-log_probs``.
        advantages: ``[B]`` or ``[B, T]``.
        loss_mask: ``[B, T]`` bool or 0/1, the valid tokens.
        variant: ``"O1"`` (weight ``L+`` only) or ``"C2"`` (``L+`` and ``L-``).
        top_surprisal_share: ``P``, the share of each advantage-sign subset that is selected.
        positive_weight: ``W``, the weight of ``L+``.
        negative_weight: ``M``, the weight of ``L-`` (C2 only).
        gate_on: the target-entropy gate. When off, every weight is 1; the selection is still made and counted.
        groups: ``[B]`` pool ids; the reference code pools each micro-batch separately.
        across_processes: pool the selection over all ranks (needs ``groups=None``).
        reduce_statistics: sum the statistics over all ranks; defaults to ``across_processes``. Either one makes this
            a collective call that every rank must make.

    Returns:
        ``(weights, selected_positive, selected_negative, stats)``: float ``[B, T]`` weights (1 outside the selection
        and outside ``loss_mask``), the bool ``L+`` and ``L-`` masks, and statistics: ``num_tokens``,
        ``num_positive``, ``num_negative``, ``num_selected_positive``, ``num_selected_negative``,
        ``selected_positive_fraction`` and ``selected_negative_fraction`` (of the valid tokens), ``mean_weight`` (over
        the valid tokens) and ``gate_on``.
    """
    variant = variant.upper()
    if variant not in STARE_VARIANTS:
        raise ValueError(f"variant must be one of {STARE_VARIANTS}, got {variant!r}.")
    if positive_weight < 0 or negative_weight < 0:
        raise ValueError(f"Weights must be non-negative, got W={positive_weight}, M={negative_weight}.")
    validate_token_inputs(log_probs, log_probs, advantages, loss_mask)

    surprisal = -log_probs.detach().to(working_dtype(log_probs))
    valid = loss_mask.bool()
    advantages = per_token_advantages(advantages.detach(), valid)
    positive = valid & (advantages > 0)
    negative = valid & (advantages < 0)

    def select(subset: torch.Tensor) -> torch.Tensor:
        return top_share_mask(surprisal, subset, top_surprisal_share, groups=groups, across_processes=across_processes)

    selected_positive = select(positive)
    selected_negative = select(negative) if variant == "C2" else torch.zeros_like(negative)

    weights = torch.ones_like(surprisal)
    if gate_on:
        weights = weights.masked_fill(selected_positive, positive_weight)
        weights = weights.masked_fill(selected_negative, negative_weight)

    counted = (valid, positive, negative, selected_positive, selected_negative)
    counts = torch.stack([mask.sum() for mask in counted]).double()
    totals = torch.cat([counts, weights.double()[valid].sum().reshape(1)])
    if across_processes if reduce_statistics is None else reduce_statistics:
        totals = all_reduce_sum(totals)
    names = ("num_tokens", "num_positive", "num_negative", "num_selected_positive", "num_selected_negative")
    stats = {name: int(count) for name, count in zip(names, totals[:5].tolist(), strict=True)}
    num_tokens = stats["num_tokens"]
    stats |= {
        "selected_positive_fraction": stats["num_selected_positive"] / num_tokens if num_tokens else 0.0,
        "selected_negative_fraction": stats["num_selected_negative"] / num_tokens if num_tokens else 0.0,
        "mean_weight": float(totals[5]) / num_tokens if num_tokens else 1.0,
        "gate_on": float(gate_on),
    }
    return STAREWeights(weights, selected_positive, selected_negative, stats)
