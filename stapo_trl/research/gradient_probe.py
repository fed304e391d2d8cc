"""The silenced tokens' share of the policy gradient at the weights, against count-matched random baselines
(`GradientProbeCallback`): every ``gradient_probe_steps``-th optimizer step, before it trains, TRL's loss is
backpropagated over each micro-batch restricted to one token set at a time (`GradientProbe`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..core.config import optimizer_steps_per_generation
from ..core.distributed import all_reduce_sum
from ..core.names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    ENTROPIES_KEY,
    LOG_PROBS_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    SHADOW_SILENCED_KEY,
    SILENCED_KEY,
    TOOL_MASK_BEFORE_RULES_KEY,
)
from ..core.token_rules import candidates_below, get_token_rule, per_token_advantages
from ..core.token_rules.random_silencing import count_matched_draw
from ..core.token_stats.statistics import restored_random_streams
from ..core.trl_seams import StepEventCallback, disable_gradient_checkpointing

PROBE_LOSS_TYPES = ("dapo", "cispo", "vespo", "dr_grpo")  # their denominator does not depend on which tokens count
PROBE_METRIC_PREFIX = "gradient_probe"
PROBE_BASELINES = ("random_positive", "random_candidate")  # in the order they are drawn


@dataclass
class GradientProbeArguments:
    """`GradientProbeCallback`'s setting (a recipe key and flag of `stapo-trl train`)."""

    gradient_probe_steps: int = field(
        default=0,
        metadata={
            "help": "Every this many optimizer steps (the first included), log under gradient_probe/ the silenced "
            "tokens' share of the squared gradient norm at the weights, against two count-matched random sets. 0 (the "
            "default) turns it off; a probe costs up to four extra forward and backward passes per micro-batch."
        },
    )

    def __post_init__(self) -> None:
        steps = self.gradient_probe_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"gradient_probe_steps must be an integer >= 0, got {steps!r}.")


def probe_problems(config) -> list[str]:
    """The settings of a run under which the probe cannot split the loss, or need a rule it does not run."""
    problems = []
    if not (getattr(config, "active_token_rules", None) or getattr(config, "shadow_token_rules", None)):
        problems.append("no token rule is on or in shadow (for GRPO, add shadow_token_rules: [s2t])")
    if config.loss_type not in PROBE_LOSS_TYPES:
        problems.append(f"loss_type={config.loss_type!r} (use one of {', '.join(PROBE_LOSS_TYPES)})")
    if config.top_entropy_quantile < 1.0:
        problems.append(f"top_entropy_quantile={config.top_entropy_quantile} (20-Entropy's mask)")
    if getattr(config, "off_policy_mask_threshold", None) is not None:
        problems.append("off_policy_mask_threshold (a sequence-level mask)")
    if getattr(config, "entropy_coef", 0.0) or getattr(config, "adaptive_entropy", False):
        problems.append("an entropy bonus")
    if config.deepspeed or config.fsdp:
        problems.append("DeepSpeed or FSDP (the probe backpropagates outside TRL's training step)")
    return problems


def gradient_share_statistics(silenced: torch.Tensor, kept: torch.Tensor) -> dict[str, float]:
    """The share statistics of two flattened gradients ``g_silenced`` and ``g_kept`` (`GradientProbe`)."""
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


def share_over_baseline(set_stats: tuple[float, float], baseline_stats: tuple[float, float]) -> float:
    """``(grad share / token share)`` of a set over the same ratio of a baseline, each given as ``(grad_sq_share,
    token_share)``; NaN where either ratio is undefined (no tokens, or a baseline gradient of 0)."""
    (set_grad, set_tokens), (base_grad, base_tokens) = set_stats, baseline_stats
    if set_tokens <= 0 or base_tokens <= 0 or not base_grad > 0 or not math.isfinite(set_grad):
        return float("nan")
    return (set_grad / set_tokens) / (base_grad / base_tokens)


def draw_seed(seed: int, global_step: int, process_index: int, salt: int) -> int:
    """One random stream per run seed, step, process (or micro-step) and draw."""
    return ((seed * 1_000_003 + global_step) * 1_009 + process_index) * 17 + salt


def loss_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """The micro-batch's loss tokens before any token rule (bool)."""
    mask = batch["completion_mask"].bool()
    tool_mask = batch.get(TOOL_MASK_BEFORE_RULES_KEY)
    return mask if tool_mask is None else mask & tool_mask.bool()


class _StepTokenSets(NamedTuple):
    """One bool mask per micro-batch: the loss tokens, and each token set of the probe."""

    loss: list[torch.Tensor]
    sets: dict[str, list[torch.Tensor]]


class GradientProbe:
    """Measures the shares every ``every`` optimizer steps over the token sets ``silenced`` (applied and shadow rules),
    ``kept`` (the rest: ``g_silenced + g_kept`` is the gradient before any rule), ``random_positive`` and
    ``random_candidate`` (count-matched draws, from ``seed``, of the positive-advantage tokens and of the pool
    ``candidate_mask(log_probs, entropies, advantages, loss_mask) -> bool [B, T]``). ``loss_fn(model, batch)`` is the
    trainer's loss, called with ``tool_mask`` narrowed to one set and the whole loss's denominator; each pass starts
    from its micro-batch's training random state, and random streams and ``.grad`` are left as found."""

    def __init__(self, every: int, *, seed: int = 0, candidate_mask: Callable | None = None):
        self.every, self.seed, self.candidate_mask = every, seed, candidate_mask

    def is_due(self, completed_steps: int) -> bool:
        return self.every > 0 and completed_steps % self.every == 0

    def token_sets(self, step_batches: list[dict[str, Any]], global_step: int, process_index: int) -> _StepTokenSets:
        loss_masks, silenced, positive, candidates = [], [], [], []
        for batch in step_batches:
            loss_mask = loss_tokens(batch)
            removed = (batch[SILENCED_KEY].bool() | batch[SHADOW_SILENCED_KEY].bool()) & loss_mask
            advantages = per_token_advantages(batch[ADVANTAGES_BEFORE_RULES_KEY].detach(), loss_mask)
            loss_masks.append(loss_mask)
            silenced.append(removed)
            positive.append(loss_mask & (advantages > 0))
            if self.candidate_mask is not None:
                candidates.append(
                    self.candidate_mask(batch[LOG_PROBS_KEY], batch[ENTROPIES_KEY], advantages, loss_mask)
                )
        count = int(sum(int(part.sum()) for part in silenced))
        sets = {"silenced": silenced, "kept": [mask & ~part for mask, part in zip(loss_masks, silenced, strict=True)]}
        pools = {"random_positive": positive, "random_candidate": candidates if self.candidate_mask else None}
        for salt, name in enumerate(PROBE_BASELINES, start=1):
            if pools[name] is not None:
                generator = torch.Generator().manual_seed(draw_seed(self.seed, global_step, process_index, salt))
                sets[name] = count_matched_draw(pools[name], count, generator)
        return _StepTokenSets(loss_masks, sets)

    def measure(
        self, loss_fn, model, step_batches: list[dict], *, global_step: int = 0, process_index: int = 0
    ) -> dict:
        started = time.perf_counter()
        token_sets = self.token_sets(step_batches, global_step, process_index)
        parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
        totals = {name: [torch.zeros_like(p, dtype=torch.float32) for p in parameters] for name in token_sets.sets}
        with restored_random_streams():
            for index, batch in enumerate(step_batches):
                # Every pass but the kept tokens' (always run, last) puts the random streams back.
                for name in sorted(token_sets.sets, key=lambda name: name == "kept"):
                    part = token_sets.sets[name][index]
                    if name != "kept" and not part.any():
                        continue
                    with nullcontext() if name == "kept" else restored_random_streams():
                        restricted = dict(batch)
                        restricted["tool_mask"] = part.to(batch["completion_mask"].dtype)
                        restricted["num_items_in_batch"] = batch[NUM_ITEMS_BEFORE_RULES_KEY]
                        restricted["advantages"] = batch[ADVANTAGES_BEFORE_RULES_KEY]
                        loss = loss_fn(model, restricted)
                        grads = torch.autograd.grad(loss, parameters, allow_unused=True)
                    for accumulated, grad in zip(totals[name], grads, strict=True):
                        if grad is not None:
                            accumulated += grad.float()
        flat = {
            name: all_reduce_sum(torch.cat([g.flatten() for g in grads]) if grads else torch.zeros(0))
            for name, grads in totals.items()
        }
        sets, silenced = token_sets.sets, token_sets.sets["silenced"]
        baselines = [name for name in PROBE_BASELINES if name in sets]
        local = [sum(int(mask.sum()) for mask in token_sets.loss)]
        local += [sum(int(part.sum()) for part in parts) for parts in sets.values()]
        for name in baselines:
            local.append(sum(int((part & removed).sum()) for part, removed in zip(sets[name], silenced, strict=True)))
        num_tokens, *reduced = all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        global_counts = dict(zip(sets, reduced[: len(sets)], strict=True))
        global_overlaps = dict(zip(baselines, reduced[len(sets) :], strict=True))
        stats = gradient_share_statistics(flat["silenced"], flat["kept"])
        whole_sq = stats["whole_grad_norm"] ** 2
        stats["num_silenced"] = global_counts["silenced"]
        stats["silenced_token_share"] = global_counts["silenced"] / num_tokens if num_tokens else 0.0
        silenced_pair = (stats["silenced_grad_sq_share"], stats["silenced_token_share"])
        for name in baselines:
            grad_sq = float(flat[name].double().square().sum())
            share = grad_sq / whole_sq if whole_sq > 0 else float("nan")
            token_share = global_counts[name] / num_tokens if num_tokens else 0.0
            stats[f"{name}_grad_sq_share"] = share
            stats[f"{name}_num_tokens"] = global_counts[name]
            stats[f"{name}_token_share"] = token_share
            stats[f"{name}_num_also_silenced"] = global_overlaps[name]
            stats[f"silenced_share_over_{name}"] = share_over_baseline(silenced_pair, (share, token_share))
        stats["seconds"] = time.perf_counter() - started
        return stats


class GradientProbeCallback(StepEventCallback):
    """Runs a `GradientProbe` every ``gradient_probe_steps`` optimizer steps of a `STAPOTrainer` run and logs under
    ``gradient_probe/`` (added by ``stapo-trl train``)."""

    def __init__(self, settings: GradientProbeArguments):
        self.settings = settings
        self.probe: GradientProbe | None = None

    def on_init_end(self, args, state, control, **kwargs):
        if problems := probe_problems(args):
            raise ValueError(
                "gradient_probe_steps measures the gradient of the tokens a rule silences, splitting the loss into "
                "the silenced and the kept tokens' parts, which is exact only when the loss is a sum over tokens with "
                f"a denominator that does not depend on which tokens count. Not with: {'; '.join(problems)}."
            )

    def on_step_tokens(self, trainer, step_batches, tokens) -> None:
        if self.probe is None:
            running = [get_token_rule(name) for name in (*trainer.token_rules, *trainer.shadow_token_rules)]
            bounds = [bound for spec in running if (bound := spec.probability_bound(trainer.args)) is not None]
            candidates = candidates_below(bounds[0]) if bounds else None
            every = self.settings.gradient_probe_steps
            self.probe = GradientProbe(every, seed=trainer.args.seed, candidate_mask=candidates)
        step = trainer.state.global_step
        if not self.probe.is_due(step):
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        checkpointing = disable_gradient_checkpointing(model, trainer.args.gradient_checkpointing_kwargs)
        rank = trainer.accelerator.process_index
        with trainer.metrics_untouched(), checkpointing:
            stats = self.probe.measure(trainer.compute_loss, model, step_batches, global_step=step, process_index=rank)
        stats["steps_since_generation"] = step % optimizer_steps_per_generation(trainer.args)
        for key, value in stats.items():
            trainer.log_metric(f"{PROBE_METRIC_PREFIX}/{key}", value)
