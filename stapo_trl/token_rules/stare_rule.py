"""STARE as a registered token rule (``"stare"``): its spec, which builds the rule's parameters from
`STAREConfigMixin` and the `STAREController`, and describes STARE to the card, the summary and the console."""

from __future__ import annotations

from typing import Any

import torch

from .registry import RuleMethod, StepContext, TokenRuleResult, TokenRuleSpec, register_token_rule_spec, rule_metric
from .stare import stare_token_weights
from .stare_config import STAREConfigMixin
from .stare_controller import STAREController

STARE_GATE_ON = rule_metric("stare", "gate_on")
STARE_POSITIVE_WEIGHT = rule_metric("stare", "positive_weight")
STARE_NEGATIVE_WEIGHT = rule_metric("stare", "negative_weight")
STARE_BATCH_ENTROPY = rule_metric("stare", "batch_entropy")


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
        return STAREController(
            target_entropy=config.stare_target_entropy,
            positive_weight=config.stare_positive_weight,
            negative_weight=config.stare_negative_weight,
            adaptive=config.stare_adaptive,
            alpha=config.stare_alpha,
            max_positive_weight=config.stare_max_positive_weight,
            min_negative_weight=config.stare_min_negative_weight,
            gate_mode=config.stare_gate,
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

    def card_settings(self, config: Any) -> list[tuple[str, str]]:
        rows = [
            ("stare_variant", "STARE variant"),
            ("stare_top_surprisal_share", "P: top surprisal share per sign"),
            ("stare_positive_weight", "W (start)"),
            ("stare_negative_weight", "M (start, C2)"),
            ("stare_target_entropy", "gate target entropy (nats)"),
            ("stare_gate", "gate mode"),
            ("stare_adaptive", "adaptive W/M"),
            ("stare_selection_pool", "selection pool"),
        ]
        return [row for row in rows if row[0] != "stare_negative_weight" or config.stare_variant == "C2"]

    def card_statistics(self, steps: list[dict[str, Any]]) -> list[str]:
        summary = self.summarize(steps)
        if not summary:
            return []
        positive, negative = summary["final_weights"]
        return [
            f"- STARE gate on in {summary['gate_on_fraction']:.0%} of logged steps; final W {positive:.3g}, "
            f"M {negative:.3g}."
        ]

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        gated = [record for record in records if record.get(STARE_GATE_ON) is not None]
        if not gated:
            return {}
        return {
            "gate_on_fraction": sum(record[STARE_GATE_ON] for record in gated) / len(gated),
            "final_weights": [gated[-1].get(STARE_POSITIVE_WEIGHT), gated[-1].get(STARE_NEGATIVE_WEIGHT)],
        }

    def summary_lines(self, summary: dict[str, Any], steps: int) -> list[str]:
        positive, negative = summary["final_weights"]
        return [
            f"STARE gate on:            {100 * summary['gate_on_fraction']:.0f}% of logged steps; final W "
            f"{positive:.3g}, M {negative:.3g}"
        ]

    def step_line(self, logs: dict[str, Any]) -> list[str]:
        if STARE_GATE_ON not in logs:
            return []
        gate = "on" if logs[STARE_GATE_ON] >= 0.5 else "off"
        return [f"stare {gate} W {logs.get(STARE_POSITIVE_WEIGHT, float('nan')):.3f}"]


register_token_rule_spec(STARERule())
