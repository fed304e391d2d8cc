"""The paper's two evaluation sampling settings (STAPO, arXiv 2602.15620, Table 2)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NEW_TOKENS = 20480
"""The paper evaluates with up to 20,480 new tokens per sample."""


@dataclass(frozen=True)
class SamplingPreset:
    name: str
    temperature: float
    top_p: float
    description: str


def sampling_label(temperature: float, top_p: float) -> str:
    """`T=1.0, top-p=1.0`, as the paper writes its settings."""
    return f"T={float(temperature)}, top-p={float(top_p)}"


SAMPLING_PRESETS: dict[str, SamplingPreset] = {
    preset.name: preset
    for preset in (
        SamplingPreset(
            "training-aligned", 1.0, 1.0, "the rollout distribution of training (the paper's first number)"
        ),
        SamplingPreset("justrl", 0.7, 0.9, "JustRL's evaluation setting (the paper's number in parentheses)"),
    )
}
