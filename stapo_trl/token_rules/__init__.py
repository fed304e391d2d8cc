"""Token rules: pure tensor functions that decide which completion tokens feed the policy gradient, and how much,
each registered with a spec that describes it to the rest of stapo-trl.

- :mod:`.registry`: :class:`TokenRuleSpec`, :class:`TokenRuleResult`, :class:`RuleMetric` (a statistic a rule
  logs, its meaning, unit and run summaries), :func:`register_token_rule_spec`, :func:`register_token_rule` (for a
  plain function) and :func:`apply_token_rules`.
- :mod:`.s2t`, :mod:`.s2t_rule`: the S2T spurious-token mask of STAPO, and its fields and spec, registered as
  ``"s2t"``.
- :mod:`.stare`, :mod:`.stare_config`, :mod:`.stare_controller`, :mod:`.stare_rule`: STARE's surprisal-guided
  advantage weights, its configuration fields, its target-entropy gate, and its spec, registered as ``"stare"``.

Importing this package imports every module in it, so a rule's module registers its spec without being listed
anywhere else. Nothing here imports TRL, so verl or a hand-written loop can use these directly.
"""

import importlib
import pkgutil

from ..file_and_metric_names import rule_metric, shadow_metric
from .registry import (
    LAST,
    MEAN,
    MEDIAN,
    STEPS_ABOVE_ZERO,
    SUM,
    SUMMARY_KINDS,
    TOKEN_RULES,
    ComposedTokenRules,
    FunctionRuleSpec,
    RuleCall,
    RuleMethod,
    RuleMetric,
    RulePresentation,
    RuleSetting,
    StepContext,
    TokenRuleResult,
    TokenRuleSpec,
    active_rule_names,
    apply_token_rules,
    get_token_rule,
    register_token_rule,
    register_token_rule_spec,
    registered_rules,
    rule_config_mixins,
    shadow_rule_names,
    switched_rules,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from .s2t import (  # noqa: E402
    ENTROPY_PERCENTILES,
    candidates_below,
    linear_quantiles,
    logit_grad_sq_norm_lower_bound,
    spurious_token_candidates,
    spurious_token_mask,
)
from .stare import STARE_VARIANTS, STAREWeights, stare_token_weights, top_share_mask  # noqa: E402
from .stare_config import STARE_SELECTION_POOLS, STAREConfigMixin  # noqa: E402
from .stare_controller import GATE_MODES, STAREController  # noqa: E402

__all__ = [
    "LAST",
    "MEAN",
    "MEDIAN",
    "STEPS_ABOVE_ZERO",
    "SUM",
    "SUMMARY_KINDS",
    "ENTROPY_PERCENTILES",
    "GATE_MODES",
    "STARE_SELECTION_POOLS",
    "STARE_VARIANTS",
    "TOKEN_RULES",
    "ComposedTokenRules",
    "FunctionRuleSpec",
    "RuleCall",
    "RuleMethod",
    "RuleMetric",
    "RulePresentation",
    "RuleSetting",
    "STAREConfigMixin",
    "STAREController",
    "STAREWeights",
    "StepContext",
    "TokenRuleResult",
    "TokenRuleSpec",
    "active_rule_names",
    "apply_token_rules",
    "candidates_below",
    "get_token_rule",
    "linear_quantiles",
    "logit_grad_sq_norm_lower_bound",
    "register_token_rule",
    "register_token_rule_spec",
    "registered_rules",
    "rule_config_mixins",
    "rule_metric",
    "shadow_metric",
    "shadow_rule_names",
    "spurious_token_candidates",
    "spurious_token_mask",
    "stare_token_weights",
    "switched_rules",
    "top_share_mask",
]
