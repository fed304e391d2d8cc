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
