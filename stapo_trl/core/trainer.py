"""`STAPOTrainer`: `GRPOTrainer` with token rules: the S2T spurious-token mask of STAPO (arXiv 2602.15620), STARE
(arXiv 2606.19236) and any rule registered in :mod:`stapo_trl.core.token_rules`.

How the rules reach TRL's loss without copying it, at the start of each optimizer step:

- A keep-mask is folded into ``tool_mask``. In ``GRPOTrainer._compute_loss`` the single tensor
  ``completion_mask * tool_mask`` multiplies the per-token loss and is the token count of the ``grpo`` and ``sapo``
  denominators (per sequence) and of ``bnpo``'s (per micro-batch): those are renormalized over the kept tokens by TRL's
  own code. The ``dapo``, ``cispo`` and ``vespo`` losses divide by a count derived from ``num_items_in_batch`` instead,
  from which the silenced tokens are subtracted (see `STAPOTrainer.apply_token_rules` for when that count is exact).
  ``dr_grpo`` and ``luspo`` have no token count in their denominators: silenced tokens only leave the numerator.
- Weights multiply the per-token advantage (TRL accepts ``[B, T]`` advantages). Every TRL 1.16 per-token loss is
  ``A`` times a factor that depends only on the sign of ``A``, so a positive weight scales the token's policy-gradient
  term, clip included, and leaves every denominator alone: a token mean not divided by the weights, as STARE asks.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import TrainingArguments

from .config import STAPOConfig
from .distributed import all_reduce_sum
from .names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    ENTROPIES_KEY,
    LOG_PROBS_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    SHADOW_SILENCED_KEY,
    SILENCED_KEY,
    TOKEN_STATS_MEAN_ENTROPY,
    TOKEN_WEIGHTS_KEY,
    TOOL_MASK_BEFORE_RULES_KEY,
    rule_metric,
    shadow_metric,
)
from .paper import PAPER_ID, PAPER_TITLE, STAPO_CITATION
from .resume import EpochSeededSampler, resolve_resume_checkpoint
from .token_rules import RuleCall, StepContext, StepTokens, apply_token_rules, get_token_rule
from .token_rules.registry import per_token_advantages, shadow_rule_names
from .token_stats.generation import unrecordable_decoding
from .token_stats.statistics import TokenStatistics
from .trl_seams import HookedGRPOTrainer, StepEventCallback, get_config_model_id

logger = logging.getLogger(__name__)


def _as_stapo_config(args: TrainingArguments) -> STAPOConfig:
    """A `STAPOConfig` holding every value of a `GRPOConfig` (or `TrainingArguments`), with S2T defaults added."""
    values = args.to_dict()
    values["hub_token"] = args.hub_token
    # GRPOConfig.__post_init__ fills both of these; only one may be given back.
    values["generation_batch_size"] = None
    config = STAPOConfig(**values)
    rules = "; ".join(get_token_rule(name).describe(config) for name in config.active_token_rules)
    logger.warning(
        "STAPOTrainer was given a %s; it was converted to a STAPOConfig with its token rules on (%s). Your values are "
        "kept as given, so epsilon_high=%s rather than STAPO's 0.28. Pass a STAPOConfig to get the paper's defaults.",
        type(args).__name__,
        rules,
        config.epsilon_high,
    )
    return config


def _check_prompt_column(dataset, environment_factory=None) -> None:
    """Refuse a training dataset without the ``prompt`` column that TRL's generation step reads (TRL itself fails
    with a ``KeyError`` at the first step, after the model has loaded). With an ``environment_factory`` the column is
    optional, as in TRL: each rollout's ``reset()`` may supply the prompt. Datasets whose columns are unknown until
    iterated (``column_names`` is None), and dicts of datasets, are left to TRL."""
    columns = getattr(dataset, "column_names", None)
    if environment_factory is None and isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(
            f"train_dataset has no 'prompt' column (its columns: {', '.join(columns) or 'none'}). STAPOTrainer, like "
            "GRPOTrainer, samples completions for the 'prompt' of each row: rename the column that holds the "
            "prompts, for example dataset.rename_column('question', 'prompt'), or pass an environment_factory "
            "whose reset() returns the prompt."
        )


class STAPOTrainer(HookedGRPOTrainer):
    """Spurious-Token-Aware Policy Optimization: GRPO/DAPO with the S2T mask (STAPO, Algorithm 1).

    Takes every argument of [`~trl.GRPOTrainer`]; `args` should be a [`STAPOConfig`] (a `GRPOConfig` is converted,
    keeping its values). At the start of each optimizer step the token rules (`args.active_token_rules`) apply in order
    to all its micro-batches, across processes, as one pool; `args.shadow_token_rules` are computed and logged only.
    The loss is renormalized over the kept tokens (the module docstring says how). A rule's controller (STARE's gate)
    lives in `self.rule_controllers` and is saved with each checkpoint.

    `self.token_stats` says where p and H come from (`token_stats_source`): `"generation"`, the generating policy
    (exact when each generation feeds one optimizer step; otherwise up to `steps_per_generation /
    gradient_accumulation_steps * num_iterations - 1` updates stale), or `"loss"`, the policy being optimized, as in
    the paper (docs/semantics.md). Evaluation losses are reported without the rules. Callbacks that subclass
    `StepEventCallback` also get what only the step sees (docs/architecture.md).
    """

    card_name = "STAPO"
    card_tags = ("trl", "grpo", "stapo")
    card_paper = {"title": PAPER_TITLE, "id": PAPER_ID, "citation": STAPO_CITATION}

    token_stats: TokenStatistics | None = None

    def __init__(self, model, reward_funcs=None, args: STAPOConfig | None = None, *positional, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = STAPOConfig(f"{model_name.split('/')[-1]}-STAPO")
        elif not isinstance(args, STAPOConfig):
            args = _as_stapo_config(args)
        given = inspect.signature(super().__init__).bind_partial(model, reward_funcs, args, *positional, **kwargs)
        given = given.arguments
        _check_prompt_column(given.get("train_dataset"), given.get("environment_factory"))
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self.token_rules = args.active_token_rules
        self.shadow_token_rules = shadow_rule_names(args)
        running = [get_token_rule(name) for name in (*self.token_rules, *self.shadow_token_rules)]
        self.rule_controllers = {spec.name: c for spec in running if (c := spec.make_controller(args)) is not None}
        if running:
            self.token_stats = TokenStatistics(
                source=args.token_stats_source,
                backend=args.token_stats_backend,
                temperature=self.temperature,
                chunk_size=args.per_device_train_batch_size,
                get_model=lambda: self.model,
                accelerator=self.accelerator,
                model_head_pass=self.per_token_logps_and_entropies,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
                vision_language=self.is_vision_language_model,
                fsdp=self.is_fsdp_enabled,
                generation_statistics_required=any(spec.needs_generation_statistics for spec in running),
            )
        self.last_rewards: torch.Tensor | None = None
        """The rewards of the last training generation on this process, ``[completions, reward functions]``."""

    def step_event_callbacks(self) -> list[StepEventCallback]:
        return [c for c in self.callback_handler.callbacks if isinstance(c, StepEventCallback)]

    # ------------------------------------------------------------------ statistics
    def per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        stats = self.token_stats
        capture = stats is not None and stats.is_gathering and not self._is_reference_forward(model)
        logps, entropies, aux_loss = super().per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy or capture,
            **kwargs,
        )
        if capture:
            stats.capture(logps, entropies)
            if not compute_entropy:
                entropies = None
        return logps, entropies, aux_loss

    def _is_reference_forward(self, model) -> bool:
        """Whether TRL is computing the reference log-probs of its KL term (``beta > 0``): with the separate
        ``ref_model``, or with the policy's PEFT adapters switched off or switched to the ``"ref"`` adapter. STAPO's
        statistics come only from the policy's own passes, and the reference model's head may not compute entropy."""
        if self.ref_model is not None and model is self.ref_model:
            return True
        unwrapped = self.accelerator.unwrap_model(model)
        if not is_peft_model(unwrapped):
            return False
        if unwrapped.active_adapter == "ref":
            return True
        return any(isinstance(module, BaseTunerLayer) and module.disable_adapters for module in unwrapped.modules())

    # ------------------------------------------------------------------ generation
    def generation_stats_blocker(self) -> str | None:
        """Why p and H cannot be recorded while `generate()` samples in this run, or None when they can.

        Recording needs TRL's own `generate()` path, called once per generation, on a model whose LM-head output is
        the logits the loss uses."""
        if self.use_vllm:
            return "vLLM generates the completions"
        if self.args.use_transformers_continuous_batching:
            return "transformers' continuous batching generates the completions"
        if self.rollout_func is not None:
            return "a rollout_func generates the completions"
        if self.tools or getattr(self, "environment_factories", None):
            return "tool calls make several generate() calls per completion"
        decoding = unrecordable_decoding(self.args.generation_kwargs)
        if decoding is not None:
            return decoding
        if self.is_vision_language_model:
            return "vision-language model"
        if self.token_stats.logit_transforms:
            return (
                f"the model transforms its logits after the LM head ({', '.join(self.token_stats.logit_transforms)})"
            )
        if self.token_stats.sharded_by is not None:
            return f"{self.token_stats.sharded_by} shards the LM head"
        return None

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.last_rewards = super().calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.last_rewards

    def generate_single_turn(self, prompt_ids, *args, **kwargs):
        with nullcontext() if self.token_stats is None else self.token_stats.recording_generate():
            return super().generate_single_turn(prompt_ids, *args, **kwargs)

    def generate_and_score_completions(self, inputs):
        stats = self.token_stats
        if stats is None or not self.model.training:
            return super().generate_and_score_completions(inputs)
        stats.begin_generation(record_generate=self.generation_stats_blocker() is None)
        try:
            output = super().generate_and_score_completions(inputs)
        except BaseException:
            stats.abandon_generation()
            raise
        stats.finish_generation(output, self.state.global_step)
        output[TOOL_MASK_BEFORE_RULES_KEY] = output.get("tool_mask")
        output[NUM_ITEMS_BEFORE_RULES_KEY] = output["num_items_in_batch"]
        output[ADVANTAGES_BEFORE_RULES_KEY] = output["advantages"]
        if self.rule_controllers:
            entropy = self._mean_token_entropy(output)
            for controller in self.rule_controllers.values():
                controller.update(entropy)
        for callback in self.step_event_callbacks():
            callback.on_generation_scored(self, output, self.last_rewards)
        return output

    @staticmethod
    def _loss_mask_before_rules(batch: dict[str, Any]) -> torch.Tensor:
        """The tokens TRL's loss counts before any token rule: completion tokens that are not tool output."""
        tool_mask = batch[TOOL_MASK_BEFORE_RULES_KEY]
        return batch["completion_mask"] if tool_mask is None else batch["completion_mask"] * tool_mask

    @staticmethod
    def _mean_token_entropy(batch: dict[str, Any]) -> float:
        """Mean entropy of the loss tokens of a batch (before the rules), over all processes."""
        return STAPOTrainer._mean_entropy(batch[ENTROPIES_KEY], STAPOTrainer._loss_mask_before_rules(batch).bool())

    def on_optimizer_step_start(self, step_batches: list[dict[str, Any]]) -> None:
        if self.token_stats is not None:
            self.apply_token_rules(step_batches)

    def on_training_micro_batch(self, inputs: dict[str, Any]) -> None:
        for callback in self.step_event_callbacks():
            callback.on_micro_batch(self, inputs)

    # ------------------------------------------------------------------ the token rules
    def token_rule_calls(self, step_batches: list[dict[str, Any]]) -> list[RuleCall]:
        """The rules to run for one optimizer step, applied and in shadow, in the order of their specs (your own
        `token_rules` in the order listed), each with the parameters its spec builds from the config, the step and
        its controller."""
        step = StepContext(
            micro_batch_sizes=tuple(batch["completion_ids"].size(0) for batch in step_batches),
            global_step=self.state.global_step,
            seed=self.args.seed,
            process_index=self.accelerator.process_index,
            device=step_batches[0]["completion_ids"].device,
        )
        named = [(name, False) for name in self.token_rules] + [(name, True) for name in self.shadow_token_rules]
        named.sort(key=lambda item: get_token_rule(item[0]).order)
        return [
            RuleCall(name, get_token_rule(name).params(self.args, step, self.rule_controllers.get(name)), shadow)
            for name, shadow in named
        ]

    def apply_token_rules(self, step_batches: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
        """Apply the token rules to one optimizer step's micro-batches in place (``tool_mask``, ``num_items_in_batch``,
        ``advantages`` and the ``stapo_*`` diagnostics keys, as `set_kept_tokens` says), log their statistics, and
        return the applied rules' statistics by name.
        """
        self.token_stats.ensure_for_step(step_batches, self.state.global_step)
        loss_mask = torch.cat([self._loss_mask_before_rules(batch) for batch in step_batches]).bool()
        log_probs = torch.cat([batch[LOG_PROBS_KEY] for batch in step_batches])
        entropies = torch.cat([batch[ENTROPIES_KEY] for batch in step_batches])
        unweighted_advantages = torch.cat([batch[ADVANTAGES_BEFORE_RULES_KEY] for batch in step_batches])
        composed = apply_token_rules(
            self.token_rule_calls(step_batches), log_probs, entropies, unweighted_advantages, loss_mask
        )
        silenced = loss_mask & ~composed.keep
        shadow_silenced = torch.zeros_like(silenced)
        for dropped in composed.shadow_silenced.values():
            shadow_silenced |= dropped

        weights = composed.weights
        if weights is not None and bool((weights == 1).all()):
            weights = None
        self.set_kept_tokens(step_batches, silenced, weights)
        sizes = [batch["completion_ids"].size(0) for batch in step_batches]
        for batch, batch_shadow in zip(step_batches, shadow_silenced.split(sizes), strict=True):
            batch[SHADOW_SILENCED_KEY] = batch_shadow
        logged = [(rule_metric, composed.stats), (shadow_metric, composed.shadow_stats)]
        logged.append((rule_metric, {rule: c.metrics() for rule, c in self.rule_controllers.items()}))
        for metric, by_rule in logged:
            for rule, rule_stats in by_rule.items():
                for key, value in rule_stats.items():
                    self.log_metric(metric(rule, key), value)
        self.log_metric(TOKEN_STATS_MEAN_ENTROPY, self._mean_entropy(entropies, loss_mask))
        callbacks = self.step_event_callbacks()
        if callbacks:
            tokens = StepTokens(
                log_probs=log_probs,
                entropies=entropies,
                advantages=unweighted_advantages,
                loss_mask=loss_mask,
                completion_ids=torch.cat([batch["completion_ids"] for batch in step_batches]),
                silenced=silenced,
                shadow_silenced=shadow_silenced,
            )
            for callback in callbacks:
                callback.on_step_tokens(self, step_batches, tokens)
        return composed.stats

    def set_kept_tokens(
        self, step_batches: list[dict[str, Any]], silenced: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        """Fold one optimizer step's silenced tokens (bool, its micro-batches' rows concatenated) and token weights
        (or None) into its micro-batches as TRL's loss reads them: ``tool_mask``, ``num_items_in_batch`` and
        ``advantages`` (see the module docstring), and ``stapo_silenced`` and ``stapo_token_weights``. It reads only
        the values the batches held before the rules, so it may be called again on the same batches with another
        selection (`stapo_trl.research.counterfactual.replay` does)."""
        num_silenced = int(all_reduce_sum(silenced.sum().reshape(1))[0])
        # dapo, cispo and vespo: each process divides its micro-batch's loss sum by num_items_in_batch / P * GA / spg,
        # where num_items_in_batch counts the loss tokens of the whole generation over all P processes and spg is
        # steps_per_generation. Once the gradients are averaged over processes and summed over the GA micro-batches,
        # the step's loss is divided by num_items_in_batch * GA / spg: the generation's tokens per optimizer step, on
        # average. Subtracting each silenced token spg / GA times turns that into the average minus this step's
        # silenced tokens. It is this step's kept tokens exactly when spg == GA (one generation per optimizer step);
        # otherwise it is off by as much as TRL's own count (this step's tokens minus the generation's average).
        silenced_at_generation_scale = num_silenced * (
            self.args.steps_per_generation // self.args.gradient_accumulation_steps
        )
        sizes = [batch["completion_ids"].size(0) for batch in step_batches]
        weight_chunks = [None] * len(sizes) if weights is None else weights.split(sizes)
        for batch, batch_silenced, batch_weights in zip(
            step_batches, silenced.split(sizes), weight_chunks, strict=True
        ):
            keep = (~batch_silenced).to(batch["completion_mask"].dtype)
            tool_mask_before_rules = batch[TOOL_MASK_BEFORE_RULES_KEY]
            batch["tool_mask"] = keep if tool_mask_before_rules is None else tool_mask_before_rules * keep
            batch["num_items_in_batch"] = batch[NUM_ITEMS_BEFORE_RULES_KEY] - silenced_at_generation_scale
            advantages = batch[ADVANTAGES_BEFORE_RULES_KEY]
            if batch_weights is not None:
                advantages = per_token_advantages(advantages, batch_weights) * batch_weights
            batch["advantages"] = advantages
            batch[SILENCED_KEY] = batch_silenced
            batch[TOKEN_WEIGHTS_KEY] = batch_weights

    @staticmethod
    def _mean_entropy(entropies: torch.Tensor, loss_mask: torch.Tensor) -> float:
        """Mean finite entropy over ``loss_mask``, over all processes (NaN without one)."""
        counted = loss_mask & torch.isfinite(entropies)
        total, count = all_reduce_sum(
            torch.stack([entropies.double()[counted].sum(), counted.sum().double()])
        ).tolist()
        return total / count if count else float("nan")

    # ------------------------------------------------------------------ model card
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card (which cites STAPO), tagged with the methods of the rules on and given a section that names the
        token rules and their thresholds; then each `StepEventCallback`'s ``on_model_card``."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [name for name in self.rule_method_names() if name not in tags]
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        card = Path(self.args.output_dir) / "README.md"
        if not self.is_world_process_zero() or not card.is_file():
            return
        rules = [get_token_rule(name).describe(self.args) for name in self.token_rules]
        rules += [
            f"{get_token_rule(name).describe(self.args)} (in shadow: logged, not applied)"
            for name in self.shadow_token_rules
        ]
        if rules:
            section = "\n## Token rules\n\n" + "".join(f"- {rule}\n" for rule in rules)
            text = card.read_text()
            anchor = text.find("\n## Citations")
            card.write_text(text + section if anchor < 0 else text[:anchor] + section + text[anchor:])
        for callback in self.step_event_callbacks():
            callback.on_model_card(self, card, model_name=model_name, dataset_name=dataset_name)

    def rule_method_names(self) -> list[str]:
        """The ``method:`` presets of the token rules this run applies (``stapo`` for S2T)."""
        return [spec.method.name for name in self.token_rules if (spec := get_token_rule(name)).method is not None]

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (`stapo_trl.core.resume`)."""
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(checkpoint, *args, **kwargs)

    def wrap_train_sampler(self, sampler):
        """TRL's sampler, moved to each epoch's shuffle on `set_epoch`, so a resumed run sees the same prompts."""
        return EpochSeededSampler(sampler)

    def save_extra_state(self, output_dir):
        """Save the rules' controllers and each `StepEventCallback`'s state, before ``trainer_state.json`` marks the
        checkpoint complete."""
        if not self.args.should_save:
            return
        for controller in self.rule_controllers.values():
            controller.save_to(output_dir)
        for callback in self.step_event_callbacks():
            callback.on_save_state(self, output_dir)

    def load_extra_state(self, checkpoint):
        for controller in self.rule_controllers.values():
            controller.restore_from(checkpoint)
        for callback in self.step_event_callbacks():
            callback.on_load_state(self, checkpoint)
