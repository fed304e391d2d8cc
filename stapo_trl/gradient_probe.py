"""The silenced tokens' share of the policy gradient, measured at the weights.

`s2t/logit_grad_sq_share_estimate` is a formula at the logits; it cannot say how much the silenced tokens move the
weights, where the contributions of many tokens add up or cancel. The probe measures it. Every
``gradient_probe_steps``-th optimizer step, before the step trains, it runs TRL's own loss twice over each of the
step's micro-batches, once restricted to the silenced tokens and once to the kept ones, both with the denominator of
the loss over all tokens (the GRPO loss), and backpropagates each:

- ``g_silenced = d L_silenced / d theta`` and ``g_kept = d L_kept / d theta``, summed over the micro-batches and the
  processes, with ``L_silenced + L_kept = L``, the loss before any token rule;
- ``silenced_grad_sq_share = |g_silenced|^2 / |g_silenced + g_kept|^2``, ``cosine_silenced_whole`` and
  ``cosine_silenced_kept``, beside ``silenced_token_share``, the silenced tokens' share of the loss tokens.

"Silenced" means the tokens the applied rules removed and, for rules in shadow, the tokens they would have removed,
so GRPO with S2T in shadow measures exactly what STAPO would remove. The advantages are the generation's own, before
any rule's weights.

The split is exact only when the loss is a sum over tokens with a denominator that does not depend on which tokens
count: ``loss_type`` ``dapo``, ``cispo``, ``vespo`` or ``dr_grpo``, without 20-Entropy's entropy mask, TRL's
off-policy sequence mask or an entropy bonus; other settings are refused. The passes run with dropout off and the
random streams forked (the run draws the same numbers with or without the probe), and they leave the parameters'
``.grad`` as they found them. Each probe costs two forward and backward passes per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .distributed import all_reduce_sum
from .names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    SHADOW_SILENCED_KEY,
    SILENCED_KEY,
    TOOL_MASK_BEFORE_RULES_KEY,
)

PROBE_LOSS_TYPES = ("dapo", "cispo", "vespo", "dr_grpo")
"""The loss types whose denominator does not depend on which tokens count, so that the loss splits into the silenced
tokens' part and the kept tokens' part."""
PROBE_METRIC_PREFIX = "gradient_probe"


def probe_metric(statistic: str) -> str:
    return f"{PROBE_METRIC_PREFIX}/{statistic}"


@dataclass
class GradientProbeConfigMixin:
    r"""
    The gradient probe: the silenced tokens' share of the policy gradient at the weights.

    Parameters:
        gradient_probe_steps (`int`, *optional*, defaults to `0`):
            Every this many optimizer steps (the first step included), measure the squared norm of the gradient of
            the silenced tokens' part of the loss against the whole loss's, and their cosine. `0` turns it off. Each
            probe costs two extra forward and backward passes per micro-batch.
    """

    gradient_probe_steps: int = field(
        default=0,
        metadata={
            "help": "Every this many optimizer steps (the first included), measure the silenced tokens' share of the "
            "squared gradient norm at the weights, and the cosine with the whole gradient, logged under "
            "gradient_probe/. 0 (the default) turns it off; each probe costs two extra forward and backward passes "
            "per micro-batch."
        },
    )

    def validate_gradient_probe_fields(self) -> None:
        steps = self.gradient_probe_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"gradient_probe_steps must be an integer >= 0, got {steps!r}.")
        if steps == 0:
            return
        problems = []
        if self.loss_type not in PROBE_LOSS_TYPES:
            problems.append(f"loss_type={self.loss_type!r} (use one of {', '.join(PROBE_LOSS_TYPES)})")
        if self.top_entropy_quantile < 1.0:
            problems.append(f"top_entropy_quantile={self.top_entropy_quantile} (20-Entropy's mask)")
        if getattr(self, "off_policy_mask_threshold", None) is not None:
            problems.append("off_policy_mask_threshold (a sequence-level mask)")
        if getattr(self, "entropy_coef", 0.0) or getattr(self, "adaptive_entropy", False):
            problems.append("an entropy bonus")
        if problems:
            raise ValueError(
                "gradient_probe_steps splits the loss into the silenced and the kept tokens' parts, which is exact only "
                "when the loss is a sum over tokens with a denominator that does not depend on which tokens count. "
                f"Not with: {'; '.join(problems)}."
            )


def gradient_share_statistics(silenced: torch.Tensor, kept: torch.Tensor) -> dict[str, float]:
    """The share statistics of two flattened gradients ``g_silenced`` and ``g_kept`` (see the module docstring)."""
    silenced, kept = silenced.double(), kept.double()
    whole = silenced + kept
    silenced_sq, kept_sq, whole_sq = (float(vector.square().sum()) for vector in (silenced, kept, whole))

    def cosine(a: torch.Tensor, b: torch.Tensor, a_sq: float, b_sq: float) -> float:
        return float(a @ b) / math.sqrt(a_sq * b_sq) if a_sq > 0 and b_sq > 0 else float("nan")

    return {
        "silenced_grad_sq_share": silenced_sq / whole_sq if whole_sq > 0 else float("nan"),
        "cosine_silenced_whole": cosine(silenced, whole, silenced_sq, whole_sq),
        "cosine_silenced_kept": cosine(silenced, kept, silenced_sq, kept_sq),
        "silenced_grad_norm": math.sqrt(silenced_sq),
        "whole_grad_norm": math.sqrt(whole_sq),
    }


class GradientProbe:
    """Measures the share at the steps it is due. ``loss_fn(model, batch)`` is the trainer's own loss (TRL's
    ``compute_loss``), called with the batch's ``tool_mask`` narrowed to one part of the tokens."""

    def __init__(self, every: int):
        self.every = every

    def is_due(self, completed_steps: int) -> bool:
        return self.every > 0 and completed_steps % self.every == 0

    def measure(self, loss_fn, model: torch.nn.Module, step_batches: list[dict[str, Any]]) -> dict[str, float]:
        parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
        silenced_parts, kept_parts, num_silenced, num_tokens = [], [], 0, 0
        for batch in step_batches:
            loss_mask = batch["completion_mask"].bool()
            if batch.get(TOOL_MASK_BEFORE_RULES_KEY) is not None:
                loss_mask &= batch[TOOL_MASK_BEFORE_RULES_KEY].bool()
            removed = batch[SILENCED_KEY].bool() | batch[SHADOW_SILENCED_KEY].bool()
            removed &= loss_mask
            num_silenced += int(removed.sum())
            num_tokens += int(loss_mask.sum())
            silenced_parts.append(removed)
            kept_parts.append(loss_mask & ~removed)
        gradients = []
        for parts in (silenced_parts, kept_parts):
            total = [torch.zeros_like(parameter, dtype=torch.float32) for parameter in parameters]
            for batch, part in zip(step_batches, parts, strict=True):
                if not part.any():
                    continue
                restricted = dict(batch)
                restricted["tool_mask"] = part.to(batch["completion_mask"].dtype)
                restricted["num_items_in_batch"] = batch[NUM_ITEMS_BEFORE_RULES_KEY]
                restricted["advantages"] = batch[ADVANTAGES_BEFORE_RULES_KEY]
                loss = loss_fn(model, restricted)
                grads = torch.autograd.grad(loss, parameters, allow_unused=True)
                for accumulated, grad in zip(total, grads, strict=True):
                    if grad is not None:
                        accumulated += grad.float()
            gradients.append(torch.cat([grad.flatten() for grad in total]) if total else torch.zeros(0))
        silenced_gradient, kept_gradient = (all_reduce_sum(gradient) for gradient in gradients)
        counts = all_reduce_sum(torch.tensor([num_silenced, num_tokens], dtype=torch.float64)).tolist()
        stats = gradient_share_statistics(silenced_gradient, kept_gradient)
        stats["num_silenced"] = counts[0]
        stats["silenced_token_share"] = counts[0] / counts[1] if counts[1] else 0.0
        return stats
