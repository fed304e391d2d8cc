"""stapo-trl: STAPO (Spurious-Token-Aware Policy Optimization) for Hugging Face TRL.

The token rules and the fused statistics backends are pure tensor code and import without TRL. Every name is loaded
on first access, so importing the package imports neither torch nor TRL (the command line sets torch's environment
variables before torch loads).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from .version import __version__ as __version__

_LAZY = {
    "STAPOConfig": ".config",
    "STAPOTrainer": ".trainer",
    "cpu_runtime": ".cpu",
    "token_logprob_entropy": ".fused_stats",
    "linear_quantiles": ".token_rules",
    "logit_grad_sq_norm_lower_bound": ".token_rules",
    "spurious_token_mask": ".token_rules",
}

if TYPE_CHECKING:
    from .config import STAPOConfig
    from .cpu import cpu_runtime
    from .fused_stats import token_logprob_entropy
    from .token_rules import linear_quantiles, logit_grad_sq_norm_lower_bound, spurious_token_mask
    from .trainer import STAPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "STAPOConfig",
    "STAPOTrainer",
    "cpu_runtime",
    "linear_quantiles",
    "logit_grad_sq_norm_lower_bound",
    "spurious_token_mask",
    "token_logprob_entropy",
]
