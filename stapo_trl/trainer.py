"""`STAPOTrainer`: `GRPOTrainer` with the S2T spurious-token mask of STAPO (arXiv 2602.15620).

How the mask reaches TRL's loss without copying it: in ``GRPOTrainer._compute_loss`` the single tensor
``completion_mask * tool_mask`` is both the multiplier of the per-token loss and every denominator, and the
token-level losses (``dapo``, ``cispo``, ``vespo``) divide by ``num_items_in_batch``. At the start of each optimizer
step this trainer folds the keep-mask into ``tool_mask`` of that step's micro-batches and subtracts the silenced
tokens from ``num_items_in_batch``. Every loss type is thereby renormalized over the kept tokens, with TRL's own
aggregation code.
"""

from __future__ import annotations

import logging
import textwrap
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainingArguments
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id, maybe_gather_lm_head_ctx

from .config import STAPOConfig
from .fused_stats import resolve_backend, token_logprob_entropy
from .token_rules import spurious_token_mask

logger = logging.getLogger(__name__)

STAPO_CITATION = textwrap.dedent("""\
    @article{liu2026stapo,
        title        = {{STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens}},
        author       = {Shiqi Liu and Zeyu He and Guojian Zhan and Letian Tao and Zhilong Zheng and Jiang Wu and Yinuo Wang and Yang Guan and Kehua Sheng and Bo Zhang and Keqiang Li and Jingliang Duan and Shengbo Eben Li},
        year         = 2026,
        eprint       = {arXiv:2602.15620},
    }""")

# Batch keys that `_get_per_token_logps_and_entropies` takes for vision-language inputs.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# Config attributes with which TRL's fused head rescales or soft-caps logits; the direct ops do neither.
LOGIT_TRANSFORM_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)

# Keys this trainer adds to TRL's batch dicts (batch-first tensors, so TRL's shuffle and split carry them).
LOG_PROBS_KEY = "s2t_log_probs"
ENTROPIES_KEY = "s2t_entropies"
UNMASKED_TOOL_MASK_KEY = "s2t_unmasked_tool_mask"
UNMASKED_NUM_ITEMS_KEY = "s2t_unmasked_num_items"
SPURIOUS_KEY = "s2t_spurious"


def _as_stapo_config(args: TrainingArguments) -> STAPOConfig:
    """A `STAPOConfig` holding every value of a `GRPOConfig` (or `TrainingArguments`), with S2T defaults added."""
    values = args.to_dict()
    values["hub_token"] = args.hub_token
    # GRPOConfig.__post_init__ fills both of these; only one may be given back.
    values["generation_batch_size"] = None
    config = STAPOConfig(**values)
    logger.warning(
        "STAPOTrainer was given a %s; it was converted to a STAPOConfig with the S2T mask on (prob_threshold=%s, "
        "entropy_quantile=%s). Your values are kept as given, so epsilon_high=%s rather than STAPO's 0.28. Pass a "
        "STAPOConfig to get the paper's defaults.",
        type(args).__name__,
        config.prob_threshold,
        config.entropy_quantile,
        config.epsilon_high,
    )
    return config


class STAPOTrainer(GRPOTrainer):
    """Spurious-Token-Aware Policy Optimization: GRPO/DAPO with the S2T mask (STAPO, Algorithm 1).

    Takes every argument of [`~trl.GRPOTrainer`]; `args` should be a [`STAPOConfig`] (a `GRPOConfig` is converted,
    keeping its values).

    At the start of each optimizer step, the tokens of all its micro-batches, across processes, form one pool. A token
    of a positive-advantage response with `p < prob_threshold` is a candidate; candidates whose entropy is below the
    `entropy_quantile`-th quantile of the candidates' entropies are silenced, and the loss is renormalized over the
    kept tokens (see the module docstring for how).

    Where `p` and `H` come from (`token_stats_source`):

    - `"generation"` (default): the policy that generated the batch. When TRL already runs its old-log-prob pass
      (vLLM importance-sampling correction, or `num_iterations > 1`, or misaligned accumulation) the statistics are
      taken from that pass, at no extra forward; otherwise one no-grad pass runs per generation. When every generation
      feeds exactly one optimizer step (`steps_per_generation == gradient_accumulation_steps`, `num_iterations == 1`)
      that policy *is* the policy being optimized, so the mask equals the loss-time mask. Otherwise the statistics are
      stale by at most `steps_per_generation / gradient_accumulation_steps * num_iterations - 1` updates.
    - `"loss"`: the policy being optimized in the step, as in the paper. A no-grad pass over the step's micro-batches
      runs when the step starts, except in the first step after a generation whose statistics already exist.

    Evaluation losses are reported without the mask: S2T changes training gradients only.
    """

    _tag_names = ["trl", "grpo", "stapo"]
    _name = "STAPO"
    _paper = {
        "title": "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens",
        "id": "2602.15620",
        "citation": STAPO_CITATION,
    }

    # (log_probs, entropies) of every `_get_per_token_logps_and_entropies` call during a training generation, or None.
    _captured_token_stats: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def __init__(self, model, reward_funcs=None, args: STAPOConfig | None = None, *positional, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = STAPOConfig(f"{model_name.split('/')[-1]}-STAPO")
        elif not isinstance(args, STAPOConfig):
            args = _as_stapo_config(args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._generation_global_step: int | None = None
        self.token_stats_backend = self._resolve_token_stats_backend() if args.use_s2t_mask else None

    # ------------------------------------------------------------------ statistics
    def _policy_parts(self):
        """The transformers model under any DDP/PEFT wrapping, its backbone and its LM head."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
        return base, base.base_model, base.get_output_embeddings()

    def _sharded_parameters(self) -> str | None:
        """Why the LM head may be sharded outside its module's forward (FSDP, ZeRO-3), or None."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if self.is_fsdp_enabled:
            return "FSDP"
        if is_deepspeed_zero3_enabled():
            return "DeepSpeed ZeRO-3"
        return None

    def _resolve_token_stats_backend(self) -> str:
        requested = self.args.token_stats_backend
        if requested == "trl":
            return "trl"
        base, _, lm_head = self._policy_parts()
        text_config = base.config.get_text_config()
        blockers = [name for name in LOGIT_TRANSFORM_ATTRIBUTES if getattr(text_config, name, None) is not None]
        if self._is_vlm:
            blockers.append("vision-language inputs")
        if blockers:
            if requested == "auto":
                return "trl"
            raise ValueError(
                f"token_stats_backend={requested!r} computes statistics from the backbone's hidden states and the LM "
                f"head alone, which does not cover this model ({', '.join(blockers)}). Use token_stats_backend='trl' "
                "(the model's own TRL fused head) or 'auto'."
            )
        sharding = self._sharded_parameters()
        if sharding is not None:
            if requested == "auto":
                return "trl"
            logger.warning(
                "token_stats_backend=%r under %s gathers the LM head outside the model's forward; this path is not "
                "covered by stapo-trl's tests. token_stats_backend='trl' (what 'auto' picks here) is.",
                requested,
                sharding,
            )
        return resolve_backend(requested, self.accelerator.device, has_bias=lm_head.bias is not None)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        capture = self._captured_token_stats is not None
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy or capture,
            **kwargs,
        )
        if capture:
            self._captured_token_stats.append((logps, entropies))
            if not compute_entropy:
                entropies = None
        return logps, entropies, aux_loss

    @torch.no_grad()
    def compute_token_stats(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(log_probs, entropies)`` ``[B, C]`` of the completions in a TRL batch under the current policy.

        Runs without gradients, in chunks of ``per_device_train_batch_size`` sequences, with the configured
        ``token_stats_backend``. Padding positions get 0.
        """
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        completion_mask = batch["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        num_completion_tokens = completion_ids.size(1)
        chunk = self.args.per_device_train_batch_size

        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if self.token_stats_backend == "trl":
                multimodal = {key: batch[key] for key in MULTIMODAL_KEYS if batch.get(key) is not None}
                log_probs, entropies, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    num_completion_tokens,
                    batch_size=chunk,
                    compute_entropy=True,
                    **multimodal,
                )
                return log_probs, entropies

            _, backbone, lm_head = self._policy_parts()
            weight, bias = lm_head.weight, lm_head.bias
            if hasattr(weight, "full_tensor"):  # FSDP2 shards parameters as DTensors
                weight = weight.full_tensor()
                bias = None if bias is None else bias.full_tensor()
            targets = completion_ids.masked_fill(completion_mask == 0, -100)
            log_probs, entropies = [], []
            for start in range(0, input_ids.size(0), chunk):
                end = start + chunk
                with self.accelerator.autocast():
                    hidden = backbone(
                        input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], use_cache=False
                    ).last_hidden_state
                # The hidden state at position j predicts token j + 1.
                hidden = hidden[:, -num_completion_tokens - 1 : -1].to(weight.device)
                with maybe_gather_lm_head_ctx(weight, bias):
                    chunk_log_probs, chunk_entropies = token_logprob_entropy(
                        hidden,
                        weight,
                        targets[start:end].to(weight.device),
                        bias=bias,
                        temperature=self.temperature,
                        backend=self.token_stats_backend,
                    )
                log_probs.append(chunk_log_probs.float())
                entropies.append(chunk_entropies.float())
        device = completion_ids.device
        return torch.cat(log_probs).to(device), torch.cat(entropies).to(device)

    # ------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        collect = self.args.use_s2t_mask and self.model.training
        self._captured_token_stats = [] if collect else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            captured, self._captured_token_stats = self._captured_token_stats, None
        if not collect:
            return output

        old_log_probs = output.get("old_per_token_logps")
        stats = next((pair for pair in captured if old_log_probs is not None and pair[0] is old_log_probs), None)
        if stats is None and self.args.token_stats_source == "generation":
            stats = self.compute_token_stats(output)
        if stats is not None:
            output[LOG_PROBS_KEY], output[ENTROPIES_KEY] = stats
        output[UNMASKED_TOOL_MASK_KEY] = output.get("tool_mask")
        output[UNMASKED_NUM_ITEMS_KEY] = output["num_items_in_batch"]
        self._generation_global_step = self.state.global_step
        return output

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.args.use_s2t_mask and self.model.training:
            accumulation = self.args.gradient_accumulation_steps
            index = self._step % self.args.steps_per_generation
            if index % accumulation == 0:
                self.apply_s2t_mask(self._buffered_inputs[index : index + accumulation])
        return inputs

    # ------------------------------------------------------------------ the mask
    def apply_s2t_mask(self, step_batches: list[dict[str, Any]]) -> dict[str, float | int]:
        """Mask the micro-batches of one optimizer step, in place, and log the S2T statistics.

        Sets ``tool_mask`` (the unmasked tool mask times the keep-mask) and ``num_items_in_batch`` (TRL's count minus
        the silenced tokens, scaled as TRL scales it) on each micro-batch, and ``s2t_spurious`` for diagnostics.
        """
        stale = self.state.global_step != self._generation_global_step
        for batch in step_batches:
            if LOG_PROBS_KEY not in batch or (self.args.token_stats_source == "loss" and stale):
                batch[LOG_PROBS_KEY], batch[ENTROPIES_KEY] = self.compute_token_stats(batch)

        loss_masks = [
            batch["completion_mask"]
            if batch[UNMASKED_TOOL_MASK_KEY] is None
            else batch["completion_mask"] * batch[UNMASKED_TOOL_MASK_KEY]
            for batch in step_batches
        ]
        spurious, stats = spurious_token_mask(
            torch.cat([batch[LOG_PROBS_KEY] for batch in step_batches]),
            torch.cat([batch[ENTROPIES_KEY] for batch in step_batches]),
            torch.cat([batch["advantages"] for batch in step_batches]),
            torch.cat(loss_masks),
            prob_threshold=self.args.prob_threshold,
            entropy_quantile=self.args.entropy_quantile,
        )

        # TRL's dapo normalizer is num_items_in_batch * GA / steps_per_generation: an optimizer step's share of the
        # generation's tokens. Subtracting the step's silenced tokens at that scale leaves kept tokens per step.
        silenced_at_generation_scale = stats["num_spurious"] * (
            self.args.steps_per_generation // self.args.gradient_accumulation_steps
        )
        sizes = [batch["completion_ids"].size(0) for batch in step_batches]
        for batch, batch_spurious in zip(step_batches, spurious.split(sizes), strict=True):
            keep = (~batch_spurious).to(batch["completion_mask"].dtype)
            unmasked_tool_mask = batch[UNMASKED_TOOL_MASK_KEY]
            batch["tool_mask"] = keep if unmasked_tool_mask is None else unmasked_tool_mask * keep
            batch["num_items_in_batch"] = batch[UNMASKED_NUM_ITEMS_KEY] - silenced_at_generation_scale
            batch[SPURIOUS_KEY] = batch_spurious
        self._log_s2t_stats(stats)
        return stats

    def _log_s2t_stats(self, stats: dict[str, float | int]) -> None:
        metrics = self._metrics["train"]
        metrics["s2t/masked_fraction"].append(stats["spurious_fraction"])
        metrics["s2t/num_masked"].append(stats["num_spurious"])
        metrics["s2t/num_candidates"].append(stats["num_candidates"])
        metrics["s2t/entropy_threshold"].append(stats["entropy_threshold"])
        for percentile in ("p50", "p80", "p99"):
            metrics[f"s2t/entropy_{percentile}"].append(stats[f"entropy_{percentile}"])
        metrics["s2t/masked_grad_sq_share"].append(stats["masked_grad_sq_share"])
