"""S2T as a registered token rule (``"s2t"``): its configuration fields (`S2TConfigMixin`, which `STAPOConfig`
inherits) and its spec, which applies :func:`~stapo_trl.core.token_rules.s2t.spurious_token_mask` and describes the
statistics it logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .registry import (
    LAST,
    MEAN,
    MEDIAN,
    STEPS_ABOVE_ZERO,
    SUM,
    RuleMethod,
    RuleMetric,
    RulePresentation,
    RuleSetting,
    TokenRuleResult,
    TokenRuleSpec,
    register_token_rule_spec,
)
from .s2t import check_s2t_thresholds, spurious_token_mask


@dataclass
class S2TConfigMixin:
    """The parameters of the S2T (silencing spurious tokens) mask of STAPO; each field's help metadata says what it
    does."""

    use_s2t_mask: bool = field(
        default=True,
        metadata={
            "help": "Silence spurious tokens (S2T) and renormalize the loss over the kept tokens (under dr_grpo and "
            "luspo, whose denominators count no tokens, silenced tokens only leave the numerator). With `False`, "
            "training is exactly GRPO."
        },
    )
    prob_threshold: float = field(
        default=0.002,
        metadata={
            "help": "tau_p, in (0, 1]: a token of a positive-advantage response is a spurious-token candidate when its "
            "probability under the policy is strictly below this value. The paper uses 0.002."
        },
    )
    entropy_quantile: float = field(
        default=0.8,
        metadata={
            "help": "q, in [0, 1]: tau_h is the q-quantile of the candidates' entropies over the whole optimizer step "
            "(all micro-batches and processes); candidates strictly below tau_h are silenced. The paper's "
            "'tau_h = 80 percent' is 0.8 (the later revision uses 0.75)."
        },
    )


_PAPER = {"prob_threshold": 0.002, "entropy_quantile": 0.8}
_SETTINGS = (
    RuleSetting("prob_threshold", "tau_p: candidates have p below"),
    RuleSetting("entropy_quantile", "q: tau_h is this quantile of the candidates' entropies"),
)
"""The thresholds in a few words, for the model card's settings table and `stapo-trl train -h`."""

_RENAMED = {  # metric: the statistic of spurious_token_mask it logs, where the names differ
    "silenced_fraction": "spurious_fraction",
    "num_silenced": "num_spurious",
    "logit_grad_sq_share_estimate": "spurious_logit_grad_sq_share_estimate",
}


class S2TRule(TokenRuleSpec):
    """The S2T mask as a token rule: keep every token that is not spurious; no weights."""

    name = "s2t"
    title = "S2T"
    switch = "use_s2t_mask"
    config_mixin = S2TConfigMixin
    order = 10
    method = RuleMethod(
        "stapo",
        "STAPO",
        "GRPO/DAPO plus the S2T mask: silence low-probability, low-entropy tokens of positive-advantage responses and "
        "renormalize the loss over the kept tokens",
    )
    metrics = (
        RuleMetric(
            "silenced_fraction",
            "silenced tokens / loss tokens of the step (the paper reports mostly < 0.01%)",
            "share of loss tokens",
            (("silenced_fraction", MEAN), ("last_silenced_fraction", LAST)),
        ),
        RuleMetric(
            "num_silenced",
            "silenced tokens of the step, over all processes",
            "tokens",
            (("silenced_tokens", SUM), ("silenced_steps", STEPS_ABOVE_ZERO)),
        ),
        RuleMetric(
            "num_candidates",
            "candidates of the step (loss tokens of positive-advantage responses with p < prob_threshold), over all "
            "processes",
            "tokens",
            (("candidates", SUM),),
        ),
        RuleMetric(
            "entropy_threshold",
            "tau_h: entropy quantile of the candidates; a step without candidates records NaN, which TRL's logger "
            "skips (a logging window with none shows `None`)",
            "nats",
            (("threshold_median", MEDIAN), ("threshold_last", LAST)),
        ),
        RuleMetric("entropy_p50", "median entropy over all loss tokens of the step", "nats"),
        RuleMetric("entropy_p80", "80th percentile of the entropy over all loss tokens of the step", "nats"),
        RuleMetric("entropy_p99", "99th percentile of the entropy over all loss tokens of the step", "nats"),
        RuleMetric(
            "logit_grad_sq_share_estimate",
            "a formula, not a measured gradient: the share of `sum_t A_t^2 (1 - 2p_t + sum_v pi_v^2)`, the squared "
            "norm of the loss's gradient with respect to the logits at ratio 1 (STAPO §3), that the silenced tokens "
            "carry, with `sum_v pi_v^2` estimated from below by `max(p^2, exp(-H))`. It says nothing about the "
            "gradient at the weights, where tokens' contributions add up and cancel",
            "share",
        ),
    )
    presentation = RulePresentation(
        step=("silenced {silenced_fraction:.3%} ({num_silenced:d} tok)", "tau_h {entropy_threshold:.3f}"),
        summary_label="S2T silenced",
        summary="{silenced_tokens} of {candidates} candidate tokens, in {silenced_steps} of {steps} steps "
        "({silenced_fraction:.3%} of loss tokens)",
        card=(
            "S2T silenced {silenced_tokens} tokens of {candidates} candidates; mean silenced fraction "
            "{silenced_fraction:.4%} of loss tokens, last step {last_silenced_fraction:.4%} (the paper reports mostly "
            "under 0.01%).",
            (
                "tau_h: median {threshold_median:.3f} nats, last {threshold_last:.3f}.",
                "tau_h: no step had a candidate token, so no entropy threshold was computed.",
            ),
        ),
        settings=_SETTINGS,
        help_title="S2T mask (STAPO)",
        help_options=(
            ("use_s2t_mask", "silence spurious tokens and renormalize the loss over the kept ones"),
            *((setting.field, f"{setting.meaning} (paper: {_PAPER[setting.field]})") for setting in _SETTINGS),
        ),
    )

    def __call__(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        """Logs every statistic of :func:`spurious_token_mask` but ``num_tokens``, under the metrics' names."""
        spurious, stats = spurious_token_mask(log_probs, entropies, advantages, loss_mask, **params)
        logged = {metric.statistic: stats[_RENAMED.get(metric.statistic, metric.statistic)] for metric in self.metrics}
        return TokenRuleResult(keep=~spurious, stats=logged)

    def validate(self, config: Any, used: bool) -> None:
        check_s2t_thresholds(config.prob_threshold, config.entropy_quantile)
        if self.is_on(config) and config.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_s2t_mask=True conflicts with top_entropy_quantile={config.top_entropy_quantile}: both select "
                "tokens by entropy, in opposite directions (20-Entropy keeps only the highest-entropy tokens without "
                "renormalizing; S2T silences the lowest-entropy low-probability positive tokens). Run one method: "
                "set top_entropy_quantile=1.0 for STAPO, or use_s2t_mask=False for 20-Entropy."
            )

    def params(self, config, step, controller) -> dict[str, Any]:
        return {"prob_threshold": config.prob_threshold, "entropy_quantile": config.entropy_quantile}

    def probability_bound(self, config: Any) -> float:
        return config.prob_threshold

    def describe(self, config) -> str:
        return f"S2T on: prob_threshold {config.prob_threshold}, entropy_quantile {config.entropy_quantile}"


register_token_rule_spec(S2TRule())
