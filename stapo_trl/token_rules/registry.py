"""The token-rule registry: rules are pure tensor functions, registered by name and applied in order.

A rule decides, for one optimizer step's completion tokens, which tokens feed the policy gradient and with what
weight. It is called as ``rule(log_probs, entropies, advantages, loss_mask, **params)`` with ``[B, T]`` tensors
(``advantages`` may be ``[B]``) and returns a :class:`TokenRuleResult`:

- ``keep``: a bool ``[B, T]`` mask. Dropped tokens leave the loss *and its denominator*: the loss is renormalized
  over the kept tokens (S2T).
- ``weights``: a non-negative float ``[B, T]`` tensor that multiplies each token's advantage, so the token's
  policy-gradient term, without changing the denominator (STARE's token-mean "not divided by the weights").
- ``stats``: plain numbers to log, under ``<rule name>/<key>``.

Rules import nothing from TRL, so verl or a hand-written loop can call them, or :func:`apply_token_rules`, directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class TokenRuleResult:
    """What one token rule decided. Either tensor may be None: the rule then keeps every token, or weights it 1."""

    keep: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    stats: dict[str, float | int] = field(default_factory=dict)


class TokenRule(Protocol):
    def __call__(
        self,
        log_probs: torch.Tensor,
        entropies: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        **params: Any,
    ) -> TokenRuleResult: ...


TOKEN_RULES: dict[str, TokenRule] = {}


def register_token_rule(name: str) -> Callable[[TokenRule], TokenRule]:
    """Register a token rule under ``name``, as a decorator. Names are unique; registering one twice is an error."""

    def register(rule: TokenRule) -> TokenRule:
        if name in TOKEN_RULES and TOKEN_RULES[name] is not rule:
            raise ValueError(f"A token rule named {name!r} is already registered ({TOKEN_RULES[name]!r}).")
        TOKEN_RULES[name] = rule
        return rule

    return register


def get_token_rule(name: str) -> TokenRule:
    if name not in TOKEN_RULES:
        raise KeyError(
            f"No token rule named {name!r}. Registered rules: {', '.join(sorted(TOKEN_RULES))}. Register yours with "
            "@stapo_trl.token_rules.register_token_rule(name) before creating the config."
        )
    return TOKEN_RULES[name]


def working_dtype(tensor: torch.Tensor) -> torch.dtype:
    """At least float32: statistics of bf16 tensors are computed in float32."""
    return torch.promote_types(tensor.dtype, torch.float32)


def validate_token_inputs(log_probs, entropies, advantages, loss_mask) -> None:
    """Raise a ValueError that names the tensor whose shape does not fit ``log_probs`` ``[B, T]``."""
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}.")
    for name, tensor in (("entropies", entropies), ("loss_mask", loss_mask)):
        if tensor.shape != log_probs.shape:
            raise ValueError(
                f"{name} must have the shape of log_probs {tuple(log_probs.shape)}, got {tuple(tensor.shape)}."
            )
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] with B, T = {tuple(log_probs.shape)}, got {tuple(advantages.shape)}."
        )


def _checked(name: str, result: TokenRuleResult, shape: torch.Size) -> TokenRuleResult:
    if not isinstance(result, TokenRuleResult):
        raise TypeError(f"Token rule {name!r} must return a TokenRuleResult, got {type(result).__name__}.")
    for what, tensor in (("keep", result.keep), ("weights", result.weights)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"Token rule {name!r} returned {what} of shape {tuple(tensor.shape)}, expected {shape}.")
    if result.keep is not None and result.keep.dtype != torch.bool:
        raise TypeError(f"Token rule {name!r} returned keep of dtype {result.keep.dtype}; it must be torch.bool.")
    if result.weights is not None and not (torch.isfinite(result.weights).all() and (result.weights >= 0).all()):
        raise ValueError(
            f"Token rule {name!r} returned weights that are negative or not finite. Weights multiply the advantage, "
            "and only a non-negative weight scales the clipped surrogate without changing which side of the clip "
            "applies."
        )
    return result


@dataclass(frozen=True)
class ComposedTokenRules:
    """The outcome of several rules: the kept tokens, the product of the weights, and each rule's statistics."""

    keep: torch.Tensor
    weights: torch.Tensor | None
    stats: dict[str, dict[str, float | int]]


def apply_token_rules(
    rules: Sequence[tuple[str, dict[str, Any]]],
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> ComposedTokenRules:
    """Apply ``(name, params)`` rules in order. Each rule sees the loss mask narrowed by the rules before it.

    ``keep`` is ``loss_mask`` with every rule's dropped tokens removed; ``weights`` is the product of the rules'
    weights (None when no rule weights). Under ``torch.distributed``, call this on every rank with the same rules.
    """
    validate_token_inputs(log_probs, entropies, advantages, loss_mask)
    keep = loss_mask.bool()
    weights = None
    stats = {}
    for name, params in rules:
        result = _checked(name, get_token_rule(name)(log_probs, entropies, advantages, keep, **params), keep.shape)
        if result.keep is not None:
            keep = keep & result.keep
        if result.weights is not None:
            weights = result.weights if weights is None else weights * result.weights
        stats[name] = dict(result.stats)
    return ComposedTokenRules(keep=keep, weights=weights, stats=stats)
