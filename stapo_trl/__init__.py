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
    "STAPOConfig": ".core.config",
    "STAPOTrainer": ".core.trainer",
    "cpu_runtime": ".cpu",
    "token_logprob_entropy": ".core.token_stats.backends",
    "linear_quantiles": ".core.token_rules",
    "logit_grad_sq_norm_lower_bound": ".core.token_rules",
    "spurious_token_mask": ".core.token_rules",
}

if TYPE_CHECKING:
    from .core.config import STAPOConfig
    from .core.token_rules import linear_quantiles, logit_grad_sq_norm_lower_bound, spurious_token_mask
    from .core.token_stats.backends import token_logprob_entropy
    from .core.trainer import STAPOTrainer
    from .cpu import cpu_runtime


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
