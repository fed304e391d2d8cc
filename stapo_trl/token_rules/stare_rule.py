"""STARE as a registered token rule (``"stare"``): its spec, which builds the rule's parameters from
`STAREConfigMixin` and the `STAREController`, and describes the statistics it logs."""

from __future__ import annotations

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
    register_token_rule_spec,
)
from .stare import stare_token_weights
from .stare_config import STAREConfigMixin
from .stare_controller import STAREController


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

    def apply(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        result = stare_token_weights(log_probs, advantages, loss_mask, **params)
        return TokenRuleResult(weights=result.weights, stats=result.stats)

    def validate(self, config: Any, used: bool) -> None:
        config.validate_stare_fields(used)
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
