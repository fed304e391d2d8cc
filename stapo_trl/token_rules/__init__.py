"""Token rules: pure tensor functions that decide which completion tokens feed the policy gradient, and how much.

- :mod:`.registry`: :class:`TokenRuleResult`, :func:`register_token_rule` and :func:`apply_token_rules`.
- :mod:`.s2t`: the S2T spurious-token mask of STAPO, registered as ``"s2t"``.
- :mod:`.stare`: STARE's surprisal-guided advantage weights, registered as ``"stare"``.
- :mod:`.stare_controller`: STARE's target-entropy gate and adaptive weights, which live across steps.
- :mod:`.stare_config`: :class:`STAREConfigMixin`, STARE's configuration fields, which `STAPOConfig` inherits.

Nothing here imports TRL, so verl or a hand-written loop can use these directly.
"""

from .registry import (
    TOKEN_RULES,
    ComposedTokenRules,
    TokenRuleResult,
    apply_token_rules,
    get_token_rule,
    register_token_rule,
)
from .s2t import (
    ENTROPY_PERCENTILES,
    linear_quantiles,
    logit_grad_sq_norm_lower_bound,
    s2t_rule,
    spurious_token_mask,
)
from .stare import STARE_VARIANTS, STAREWeights, stare_rule, stare_token_weights, top_share_mask
from .stare_config import STARE_SELECTION_POOLS, STAREConfigMixin
from .stare_controller import GATE_MODES, STAREController

__all__ = [
    "ENTROPY_PERCENTILES",
    "GATE_MODES",
    "STARE_SELECTION_POOLS",
    "STARE_VARIANTS",
    "TOKEN_RULES",
    "ComposedTokenRules",
    "STAREConfigMixin",
    "STAREController",
    "STAREWeights",
    "TokenRuleResult",
    "apply_token_rules",
    "get_token_rule",
    "linear_quantiles",
    "logit_grad_sq_norm_lower_bound",
    "register_token_rule",
    "s2t_rule",
    "spurious_token_mask",
    "stare_rule",
    "stare_token_weights",
    "top_share_mask",
]
