"""The methods of the STAPO paper's comparison (arXiv 2602.15620, Table 2) and the rules that are methods, as
`STAPOConfig` presets (`RuleMethod`s) that a recipe selects with ``method:`` and that the recipe and command line
override (docs/training.md). A rule that is a method declares it in its spec: this module names no rule."""

from __future__ import annotations

from typing import Any

from .core.token_rules import RuleMethod, get_token_rule, switched_rules


def _presets() -> dict[str, RuleMethod]:
    # The JustRL basis of the paper: clip-higher, no KL, token-level aggregation, every token rule off but its own.
    shared = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0, "loss_type": "dapo", "top_entropy_quantile": 1.0}
    shared |= {spec.switch: False for spec in switched_rules()}
    presets = [
        RuleMethod("grpo", "GRPO", "the same loss without any token rule", dict(shared)),
        RuleMethod(
            "20-entropy",
            "20-Entropy",
            "gradient only on the 20% highest-entropy tokens, without renormalization (arXiv 2506.01939), through "
            "TRL's top_entropy_quantile",
            {**shared, "top_entropy_quantile": 0.2},
        ),
        RuleMethod(
            "justrl",
            "JustRL",
            "plain GRPO/DAPO with JustRL's dual-clip c=10 for negative advantages (TRL's delta) and weight decay 0.1",
            {**shared, "delta": 10.0, "weight_decay": 0.1},
        ),
    ]
    presets += [
        RuleMethod(method.name, method.title, method.summary, {**shared, **method.defaults, spec.switch: True})
        for spec in switched_rules()
        if (method := spec.method) is not None
    ]
    order = {"stapo": 0, "grpo": 1, "20-entropy": 2, "justrl": 3}
    return {preset.name: preset for preset in sorted(presets, key=lambda preset: order.get(preset.name, 4))}


METHODS: dict[str, RuleMethod] = _presets()
METHOD_NAMES = tuple(METHODS)
METHOD_TITLES = {name: preset.title for name, preset in METHODS.items()}
_ALIASES = {"20_entropy": "20-entropy", "20entropy": "20-entropy", "entropy-20": "20-entropy", "just-rl": "justrl"}


def method_preset(name: str) -> RuleMethod:
    """The preset for ``name`` (case-insensitive; ``20_entropy`` is accepted for ``20-entropy``)."""
    key = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in METHODS:
        raise ValueError(f"Unknown method {name!r}. Choose one of: {', '.join(METHOD_NAMES)}.")
    return METHODS[key]


def infer_method(config: Any) -> str:
    """The preset a `STAPOConfig` corresponds to, read from its switches: the method of the first switched-on rule
    that has one (``"stapo"`` when S2T is on, also with STARE), else ``"20-entropy"``, ``"justrl"`` (a dual-clip
    ``delta``) or ``"grpo"``."""
    for spec in switched_rules():
        if spec.method is not None and spec.is_on(config):
            return spec.method.name
    if config.top_entropy_quantile < 1.0:
        return "20-entropy"
    return "justrl" if config.delta is not None else "grpo"


def method_title(config: Any) -> str:
    """The method's name as printed: the titles of every switched-on rule that is a method, joined with " + "
    (``"STAPO + STARE"``), or the preset's title."""
    titles = [spec.method.title for spec in switched_rules() if spec.method is not None and spec.is_on(config)]
    return " + ".join(titles) if titles else METHOD_TITLES[infer_method(config)]


def describe_token_rule(training: Any) -> str:
    """The token rules of a `STAPOConfig`, applied and in shadow, in one line: what they select, their thresholds and
    weights, and where their statistics come from."""
    rules = [get_token_rule(name).describe(training) for name in training.active_token_rules]
    rules += [
        f"{get_token_rule(name).describe(training)} (in shadow: logged, not applied)"
        for name in getattr(training, "shadow_token_rules", [])
    ]
    if not rules:
        if training.top_entropy_quantile < 1.0:
            return f"no stapo-trl rule; TRL's top_entropy_quantile {training.top_entropy_quantile} (20-Entropy)"
        return "none (no token mask or weights)"
    source = f", statistics from the {training.token_stats_source} policy, backend {training.token_stats_backend}"
    return "; then ".join(rules) + source
