"""Token rules: pure tensor functions that decide which completion tokens feed the policy gradient, and how much,
each registered with a spec (:mod:`.registry`) that describes it to the rest of stapo-trl: the S2T mask of STAPO
(:mod:`.s2t`, :mod:`.s2t_rule`, ``"s2t"``), STARE's advantage weights (:mod:`.stare` and the ``stare_*`` modules,
``"stare"``) and RANDOM silencing (:mod:`.random_silencing`).

Importing this package imports every module in it, so a rule's module registers its spec without being listed
anywhere else. Nothing here imports TRL, so verl or a hand-written loop can use these directly.
"""

import importlib
import pkgutil

from .registry import (
    TOKEN_RULES,
    RuleCall,
    RuleMethod,
    RuleMetric,
    StepContext,
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

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from .s2t import (  # noqa: E402
    candidates_below,
    linear_quantiles,
    logit_grad_sq_norm_lower_bound,
    spurious_token_candidates,
    spurious_token_mask,
)
from .stare import stare_token_weights, top_share_mask  # noqa: E402
from .stare_controller import STAREController  # noqa: E402

__all__ = [
    "TOKEN_RULES",
    "RuleCall",
    "RuleMethod",
    "RuleMetric",
    "STAREController",
    "StepContext",
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
