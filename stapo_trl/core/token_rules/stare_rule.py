"""STARE as a registered token rule (``"stare"``): its configuration fields (`STAREConfigMixin`, which `STAPOConfig`
inherits) and its spec, which builds the rule's parameters from them and the `STAREController`, and describes the
statistics it logs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .registry import (
    LAST,
    MEAN,
    RuleMethod,
    RuleMetric,
    RulePresentation,
    RuleSetting,
    StepContext,
    TokenRuleResult,
    TokenRuleSpec,
    changed_fields,
    register_token_rule_spec,
)
from .stare import STARE_VARIANTS, stare_token_weights
from .stare_controller import GATE_MODES, STAREController

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


class STARERule(TokenRuleSpec):
    """STARE's surprisal-guided advantage weights: weights only, no token is dropped. Entropies are not used by the
    rule; the controller's gate reads the generating policy's mean token entropy."""

    name = "stare"
    title = "STARE"
    switch = "use_stare"
    config_mixin = STAREConfigMixin
    order = 20
    method = RuleMethod(
        "stare",
        "STARE",
        "GRPO/DAPO plus STARE (arXiv 2606.19236): while the batch entropy is below 0.3 nats, multiply the advantage of "
        "the 10% highest-surprisal positive-advantage tokens by W (1.1 by default; variant C2 also the negative ones "
        "by M, 0.9), without renormalizing",
    )
    needs_generation_statistics = True
    metrics = (
        RuleMetric(
            "gate_on",
            "1 while the gate is on (averaged over the steps of a logging window)",
            "share of steps",
            (("gate_on_fraction", MEAN),),
        ),
        RuleMetric("positive_weight", "W in force", "weight", (("final_positive_weight", LAST),)),
        RuleMetric("negative_weight", "M in force", "weight", (("final_negative_weight", LAST),)),
        RuleMetric("batch_entropy", "the generation batch's mean token entropy that drove the gate", "nats"),
        RuleMetric(
            "num_selected_positive",
            "positive-advantage tokens selected, reported even while the gate is off",
            "tokens",
        ),
        RuleMetric(
            "num_selected_negative",
            "negative-advantage tokens selected, reported even while the gate is off",
            "tokens",
        ),
        RuleMetric("selected_positive_fraction", "positive-advantage tokens selected / valid tokens", "share"),
        RuleMetric("selected_negative_fraction", "negative-advantage tokens selected / valid tokens", "share"),
        RuleMetric("num_tokens", "the valid tokens", "tokens"),
        RuleMetric("num_positive", "valid tokens of positive-advantage responses", "tokens"),
        RuleMetric("num_negative", "valid tokens of negative-advantage responses", "tokens"),
        RuleMetric("mean_weight", "the mean weight over valid tokens (1 while the gate is off)", "weight"),
    )
    presentation = RulePresentation(
        step=("stare {gate_on:on/off} W {positive_weight:.3f}",),
        summary_label="STARE gate on",
        summary="{gate_on_fraction:.0%} of logged steps; final W {final_positive_weight:.3g}, M "
        "{final_negative_weight:.3g}",
        card=(
            "STARE gate on in {gate_on_fraction:.0%} of logged steps; final W {final_positive_weight:.3g}, M "
            "{final_negative_weight:.3g}.",
        ),
        settings=(
            RuleSetting("stare_variant", "STARE variant"),
            RuleSetting("stare_top_surprisal_share", "P: top surprisal share per sign"),
            RuleSetting("stare_positive_weight", "W (start)"),
            RuleSetting("stare_negative_weight", "M (start, C2)", when=("stare_variant", "C2")),
            RuleSetting("stare_target_entropy", "gate target entropy (nats)"),
            RuleSetting("stare_gate", "gate mode"),
            RuleSetting("stare_adaptive", "adaptive W/M"),
            RuleSetting("stare_selection_pool", "selection pool"),
        ),
    )

    def __call__(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        result = stare_token_weights(log_probs, advantages, loss_mask, **params)
        return TokenRuleResult(weights=result.weights, stats=result.stats)

    def validate(self, config: Any, used: bool) -> None:
        if isinstance(config.stare_variant, str):
            config.stare_variant = config.stare_variant.upper()
        for item in dataclasses.fields(STAREConfigMixin):
            choices = tuple(item.metadata.get("choices", ()))
            if choices and getattr(config, item.name) not in choices:
                raise ValueError(f"{item.name} must be one of {choices}, got {getattr(config, item.name)!r}.")
        if not 0.0 < config.stare_top_surprisal_share <= 1.0:
            raise ValueError(
                f"stare_top_surprisal_share must be in (0, 1], got {config.stare_top_surprisal_share}. It is a "
                "fraction: the paper's P = 10% is 0.1."
            )
        if config.stare_positive_weight <= 0 or config.stare_negative_weight <= 0:
            raise ValueError(
                f"stare_positive_weight ({config.stare_positive_weight}) and stare_negative_weight "
                f"({config.stare_negative_weight}) must be positive: they multiply advantages, and a weight of 0 or "
                "below would drop or flip a token's update."
            )
        if config.stare_target_entropy < 0:
            raise ValueError(
                f"stare_target_entropy is an entropy in nats and must be >= 0, got {config.stare_target_entropy}."
            )
        if config.stare_alpha < 0:
            raise ValueError(f"stare_alpha must be >= 0, got {config.stare_alpha}.")
        if config.stare_max_positive_weight < 1.0 or not 0.0 < config.stare_min_negative_weight <= 1.0:
            raise ValueError(
                f"The adaptive clamps must satisfy stare_max_positive_weight >= 1 and 0 < stare_min_negative_weight "
                f"<= 1, got {config.stare_max_positive_weight} and {config.stare_min_negative_weight}."
            )
        if not used:
            return
        changed = changed_fields(config, STAREConfigMixin)
        unused = []
        if config.stare_variant == "O1" and "stare_negative_weight" in changed:
            unused.append("stare_negative_weight applies only to stare_variant='C2'")
        if not config.stare_adaptive:
            unused += [
                f"{name} applies only with stare_adaptive=True"
                for name in ("stare_alpha", "stare_max_positive_weight", "stare_min_negative_weight")
                if name in changed
            ]
        if unused:
            raise ValueError(f"These STARE settings would be ignored: {'; '.join(unused)}.")
        if config.stare_adaptive:
            if not 1.0 <= config.stare_positive_weight <= config.stare_max_positive_weight:
                raise ValueError(
                    f"With stare_adaptive=True, stare_positive_weight ({config.stare_positive_weight}) must start "
                    f"inside its clamp [1, stare_max_positive_weight={config.stare_max_positive_weight}]."
                )
            if (
                config.stare_variant == "C2"
                and not config.stare_min_negative_weight <= config.stare_negative_weight <= 1.0
            ):
                raise ValueError(
                    f"With stare_adaptive=True, stare_negative_weight ({config.stare_negative_weight}) must start "
                    f"inside its clamp [stare_min_negative_weight={config.stare_min_negative_weight}, 1]."
                )
        if self.is_on(config) and config.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_stare=True conflicts with top_entropy_quantile={config.top_entropy_quantile}: STARE takes its "
                "top-surprisal share over every loss token, but 20-Entropy then drops the low-entropy "
                f"{1 - config.top_entropy_quantile:.0%} of them inside TRL's loss, so the share and the weights would "
                "refer to tokens that get no gradient. Run one method: top_entropy_quantile=1.0 for STARE, or "
                "use_stare=False for 20-Entropy."
            )

    def make_controller(self, config: Any) -> STAREController:
        """The controller configured by the ``stare_<field>`` fields (``stare_gate`` is its ``gate_mode``)."""
        configured = ("target_entropy", "positive_weight", "negative_weight", "adaptive", "alpha")
        configured += ("max_positive_weight", "min_negative_weight")
        return STAREController(
            **{name: getattr(config, f"stare_{name}") for name in configured}, gate_mode=config.stare_gate
        )

    def params(self, config: Any, step: StepContext, controller: STAREController | None) -> dict[str, Any]:
        controller = controller if controller is not None else self.make_controller(config)
        params = {
            "variant": config.stare_variant,
            "top_surprisal_share": config.stare_top_surprisal_share,
            "positive_weight": controller.positive_weight,
            "negative_weight": controller.negative_weight,
            "gate_on": controller.gate_on,
        }
        if config.stare_selection_pool == "micro_batch":
            sizes = torch.tensor(step.micro_batch_sizes, device=step.device)
            params["groups"] = torch.repeat_interleave(
                torch.arange(len(step.micro_batch_sizes), device=step.device), sizes
            )
            params["across_processes"] = False
            params["reduce_statistics"] = True
        return params

    def describe(self, config: Any) -> str:
        weights = f"W {config.stare_positive_weight}"
        if config.stare_variant == "C2":
            weights += f", M {config.stare_negative_weight}"
        if config.stare_adaptive:
            weights += (
                f" (adaptive, alpha {config.stare_alpha}, W <= {config.stare_max_positive_weight}, "
                f"M >= {config.stare_min_negative_weight})"
            )
        gate = {
            "entropy": f"gate on below {config.stare_target_entropy} nats",
            "on": "gate always on",
            "off": "gate always off",
        }[config.stare_gate]
        return (
            f"STARE {config.stare_variant} on: top {config.stare_top_surprisal_share:g} surprisal share per "
            f"{config.stare_selection_pool.replace('_', ' ')}, {weights}, {gate}"
        )


register_token_rule_spec(STARERule())
