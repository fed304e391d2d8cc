"""The methods of the STAPO paper's comparison (arXiv 2602.15620, Table 2) and STARE, as `STAPOConfig` presets.

A recipe selects one with ``method:``. The preset's values replace `STAPOConfig`'s defaults; values written in the
recipe or on the command line still override them. All five share the JustRL basis of the paper (§1.1 of the design
notes): clip-higher (``epsilon=0.2``, ``epsilon_high=0.28``), no KL (``beta=0``), token-level ``dapo`` aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SHARED = {
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "beta": 0.0,
    "loss_type": "dapo",
    "top_entropy_quantile": 1.0,
    "use_stare": False,
}


@dataclass(frozen=True)
class MethodPreset:
    name: str
    summary: str
    defaults: dict[str, Any] = field(default_factory=dict)


METHODS: dict[str, MethodPreset] = {
    preset.name: preset
    for preset in (
        MethodPreset(
            "stapo",
            "GRPO/DAPO plus the S2T mask: silence low-probability, low-entropy tokens of positive-advantage responses "
            "and renormalize the loss over the kept tokens",
            {**_SHARED, "use_s2t_mask": True},
        ),
        MethodPreset("grpo", "the same loss without any token mask", {**_SHARED, "use_s2t_mask": False}),
        MethodPreset(
            "20-entropy",
            "gradient only on the 20% highest-entropy tokens, without renormalization (arXiv 2506.01939), through "
            "TRL's top_entropy_quantile",
            {**_SHARED, "use_s2t_mask": False, "top_entropy_quantile": 0.2},
        ),
        MethodPreset(
            "justrl",
            "plain GRPO/DAPO with JustRL's dual-clip c=10 for negative advantages (TRL's delta) and weight decay 0.1",
            {**_SHARED, "use_s2t_mask": False, "delta": 10.0, "weight_decay": 0.1},
        ),
        MethodPreset(
            "stare",
            "GRPO/DAPO plus STARE (arXiv 2606.19236): while the batch entropy is below 0.3 nats, multiply the "
            "advantage of the 10% highest-surprisal positive-advantage tokens by W (1.1 by default; variant C2 also "
            "the negative ones by M, 0.9), without renormalizing",
            {**_SHARED, "use_s2t_mask": False, "use_stare": True},
        ),
    )
}
METHOD_NAMES = tuple(METHODS)
_ALIASES = {"20_entropy": "20-entropy", "20entropy": "20-entropy", "entropy-20": "20-entropy", "just-rl": "justrl"}


def method_preset(name: str) -> MethodPreset:
    """The preset for ``name`` (case-insensitive; ``20_entropy`` is accepted for ``20-entropy``)."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in METHODS:
        raise ValueError(f"Unknown method {name!r}. Choose one of: {', '.join(METHOD_NAMES)}.")
    return METHODS[key]


def infer_method(config: Any) -> str:
    """The preset a `STAPOConfig` corresponds to, read from its switches: ``"stapo"`` (S2T on, also with STARE),
    ``"stare"``, ``"20-entropy"``, ``"justrl"`` (a dual-clip ``delta``) or ``"grpo"``."""
    if config.use_s2t_mask:
        return "stapo"
    if config.use_stare:
        return "stare"
    if config.top_entropy_quantile < 1.0:
        return "20-entropy"
    if config.delta is not None:
        return "justrl"
    return "grpo"


def describe_token_rule(training: Any) -> str:
    """The active token rules of a `STAPOConfig`, in one line: what they select, their thresholds and weights."""
    rules = []
    if training.use_s2t_mask:
        rules.append(f"S2T on: prob_threshold {training.prob_threshold}, entropy_quantile {training.entropy_quantile}")
    if training.use_stare:
        weights = f"W {training.stare_positive_weight}"
        if training.stare_variant == "C2":
            weights += f", M {training.stare_negative_weight}"
        if training.stare_adaptive:
            weights += (
                f" (adaptive, alpha {training.stare_alpha}, W <= {training.stare_max_positive_weight}, "
                f"M >= {training.stare_min_negative_weight})"
            )
        gate = {
            "entropy": f"gate on below {training.stare_target_entropy} nats",
            "on": "gate always on",
            "off": "gate always off",
        }[training.stare_gate]
        rules.append(
            f"STARE {training.stare_variant} on: top {training.stare_top_surprisal_share:g} surprisal share per "
            f"{training.stare_selection_pool.replace('_', ' ')}, {weights}, {gate}"
        )
    rules += [f"{name} (registered rule)" for name in training.token_rules]
    if not rules:
        if training.top_entropy_quantile < 1.0:
            return f"no stapo-trl rule; TRL's top_entropy_quantile {training.top_entropy_quantile} (20-Entropy)"
        return "none (no token mask or weights)"
    return (
        "; then ".join(rules)
        + f", statistics from the {training.token_stats_source} policy, backend {training.token_stats_backend}"
    )
