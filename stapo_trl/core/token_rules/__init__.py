"""Token rules: pure tensor functions that decide which completion tokens feed the policy gradient, and how much, each
registered with a spec (:mod:`.registry`): the S2T mask of STAPO (:mod:`.s2t`, :mod:`.s2t_rule`), STARE's advantage
weights (:mod:`.stare`, :mod:`.stare_rule`) and RANDOM silencing (:mod:`.random_silencing`). Importing this package
registers them; nothing here imports TRL, so verl or your own loop can use them directly.
"""

from . import random_silencing, s2t_rule, stare_rule  # noqa: F401  (registers the built-in rules)
from .registry import (
    TOKEN_RULES,
    RuleCall,
    RuleMethod,
    RuleMetric,
    StepContext,
    StepTokens,
    TokenRuleResult,
    TokenRuleSpec,
    active_rule_names,
    apply_token_rules,
    get_token_rule,
    per_token_advantages,
    register_token_rule,
    registered_rules,
    rule_config_mixins,
    shadow_rule_names,
    switched_rules,
)
from .s2t import (
    candidates_below,
    linear_quantiles,
    logit_grad_sq_norm_lower_bound,
    spurious_token_candidates,
    spurious_token_mask,
)
from .stare import stare_token_weights, top_share_mask
from .stare_controller import STAREController

__all__ = [
    "TOKEN_RULES",
    "RuleCall",
    "RuleMethod",
    "RuleMetric",
    "STAREController",
    "StepContext",
    "StepTokens",
    "TokenRuleResult",
    "TokenRuleSpec",
    "active_rule_names",
    "apply_token_rules",
    "candidates_below",
    "get_token_rule",
    "linear_quantiles",
    "logit_grad_sq_norm_lower_bound",
    "per_token_advantages",
    "register_token_rule",
    "registered_rules",
    "rule_config_mixins",
    "shadow_rule_names",
    "spurious_token_candidates",
    "spurious_token_mask",
    "stare_token_weights",
    "switched_rules",
    "top_share_mask",
]
