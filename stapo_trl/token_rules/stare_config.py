"""STARE's configuration fields, as a dataclass mixin that `STAPOConfig` combines with TRL's `GRPOConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .registry import changed_fields
from .stare import STARE_VARIANTS
from .stare_controller import GATE_MODES

STARE_SELECTION_POOLS = ("micro_batch", "optimizer_step")


@dataclass
class STAREConfigMixin:
    """The parameters of STARE (surprisal-guided token-level advantage reweighting, arXiv 2606.19236); each
    field's help metadata says what it does."""

    use_stare: bool = field(
        default=False,
        metadata={
            "help": "STARE: multiply the advantage of the highest-surprisal tokens of each advantage sign (W for "
            "positive, M for negative with variant C2) while the batch entropy is below stare_target_entropy."
        },
    )
    stare_variant: str = field(
        default="O1",
        metadata={
            "help": "'O1': weight only the positive-advantage selection by W. 'C2': also weight the negative-"
            "advantage selection by M.",
            "choices": list(STARE_VARIANTS),
        },
    )
    stare_top_surprisal_share: float = field(
        default=0.1,
        metadata={
            "help": "P, in (0, 1]: ceil(P * n) of the n positive-advantage tokens (and, for C2, of the negative ones) "
            "with the highest surprisal -log p are selected; ties at the boundary are all selected."
        },
    )
    stare_positive_weight: float = field(
        default=1.1,
        metadata={
            "help": "W > 0: the advantage multiplier of the positive selection. The paper uses 1.05 at 14B/32B."
        },
    )
    stare_negative_weight: float = field(
        default=0.9,
        metadata={
            "help": "M > 0: the advantage multiplier of the negative selection (variant C2 only). The paper uses 0.95 "
            "at 14B/32B."
        },
    )
    stare_target_entropy: float = field(
        default=0.3,
        metadata={
            "help": "H_target in nats: the reweighting is on while the mean token entropy of the generation batch, "
            "under the policy that generated it, is strictly below this."
        },
    )
    stare_gate: str = field(
        default="entropy",
        metadata={
            "help": "'entropy': the closed-loop gate. 'on': always reweight (the no-gate ablation). 'off': never "
            "reweight, which trains exactly as GRPO (a check).",
            "choices": list(GATE_MODES),
        },
    )
    stare_adaptive: bool = field(
        default=False,
        metadata={
            "help": "Adaptive schedule: at each generation, W += alpha * sign(H_target - H) clipped to "
            "[1, stare_max_positive_weight], and M -= alpha * sign(H_target - H) clipped to "
            "[stare_min_negative_weight, 1]."
        },
    )
    stare_alpha: float = field(default=0.01, metadata={"help": "The adaptive schedule's step (stare_adaptive only)."})
    stare_max_positive_weight: float = field(
        default=1.5, metadata={"help": "Upper clamp of W under the adaptive schedule (stare_adaptive only)."}
    )
    stare_min_negative_weight: float = field(
        default=0.5, metadata={"help": "Lower clamp of M under the adaptive schedule (stare_adaptive only)."}
    )
    stare_selection_pool: str = field(
        default="micro_batch",
        metadata={
            "help": "Where the top-surprisal share is taken. 'micro_batch': in each micro-batch of each process "
            "separately, as the reference verl code does (the selection then depends on per_device_train_batch_size "
            "and the number of processes). 'optimizer_step': over every micro-batch of the optimizer step and every "
            "process, like the S2T pool, so the selection does not depend on how the batch is split.",
            "choices": list(STARE_SELECTION_POOLS),
        },
    )

    def validate_stare_fields(self, used: bool = True) -> None:
        """Check the STARE fields; ``used`` says whether STARE runs, so that the settings that only some variants and
        modes read are checked against the ones it runs with."""
        if isinstance(self.stare_variant, str):
            self.stare_variant = self.stare_variant.upper()
        if self.stare_variant not in STARE_VARIANTS:
            raise ValueError(f"stare_variant must be one of {STARE_VARIANTS}, got {self.stare_variant!r}.")
        if self.stare_gate not in GATE_MODES:
            raise ValueError(f"stare_gate must be one of {GATE_MODES}, got {self.stare_gate!r}.")
        if self.stare_selection_pool not in STARE_SELECTION_POOLS:
            raise ValueError(
                f"stare_selection_pool must be one of {STARE_SELECTION_POOLS}, got {self.stare_selection_pool!r}."
            )
        if not 0.0 < self.stare_top_surprisal_share <= 1.0:
            raise ValueError(
                f"stare_top_surprisal_share must be in (0, 1], got {self.stare_top_surprisal_share}. It is a "
                "fraction: the paper's P = 10% is 0.1."
            )
        if self.stare_positive_weight <= 0 or self.stare_negative_weight <= 0:
            raise ValueError(
                f"stare_positive_weight ({self.stare_positive_weight}) and stare_negative_weight "
                f"({self.stare_negative_weight}) must be positive: they multiply advantages, and a weight of 0 or "
                "below would drop or flip a token's update."
            )
        if self.stare_target_entropy < 0:
            raise ValueError(
                f"stare_target_entropy is an entropy in nats and must be >= 0, got {self.stare_target_entropy}."
            )
        if self.stare_alpha < 0:
            raise ValueError(f"stare_alpha must be >= 0, got {self.stare_alpha}.")
        if self.stare_max_positive_weight < 1.0 or not 0.0 < self.stare_min_negative_weight <= 1.0:
            raise ValueError(
                f"The adaptive clamps must satisfy stare_max_positive_weight >= 1 and 0 < stare_min_negative_weight "
                f"<= 1, got {self.stare_max_positive_weight} and {self.stare_min_negative_weight}."
            )
        if not used:
            return
        changed = changed_fields(self, STAREConfigMixin)
        unused = []
        if self.stare_variant == "O1" and "stare_negative_weight" in changed:
            unused.append("stare_negative_weight applies only to stare_variant='C2'")
        if not self.stare_adaptive:
            unused += [
                f"{name} applies only with stare_adaptive=True"
                for name in ("stare_alpha", "stare_max_positive_weight", "stare_min_negative_weight")
                if name in changed
            ]
        if unused:
            raise ValueError(f"These STARE settings would be ignored: {'; '.join(unused)}.")
        if self.stare_adaptive:
            if not 1.0 <= self.stare_positive_weight <= self.stare_max_positive_weight:
                raise ValueError(
                    f"With stare_adaptive=True, stare_positive_weight ({self.stare_positive_weight}) must start inside "
                    f"its clamp [1, stare_max_positive_weight={self.stare_max_positive_weight}]."
                )
            if self.stare_variant == "C2" and not self.stare_min_negative_weight <= self.stare_negative_weight <= 1.0:
                raise ValueError(
                    f"With stare_adaptive=True, stare_negative_weight ({self.stare_negative_weight}) must start inside "
                    f"its clamp [stare_min_negative_weight={self.stare_min_negative_weight}, 1]."
                )
