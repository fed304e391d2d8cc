"""`STAPOTrainer`: `GRPOTrainer` with token rules: the S2T spurious-token mask of STAPO (arXiv 2602.15620), STARE
(arXiv 2606.19236) and any rule registered in :mod:`stapo_trl.token_rules`.

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
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainingArguments

from . import policy_stats
from .config import STAPOConfig
from .diagnostics.token_dump import SilencedTokenDump, StepTokens
from .distributed import all_reduce_sum
from .fused_stats.generation import GenerationStatsRecorder, unrecordable_decoding
from .model_card import PAPER_ID, PAPER_TITLE, STAPO_CITATION, fill_trl_nones, write_card_sections
from .names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    ENTROPIES_KEY,
    LOG_PROBS_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    SILENCED_KEY,
    STARE_BATCH_ENTROPY,
    STARE_NEGATIVE_WEIGHT,
    STARE_POSITIVE_WEIGHT,
    TOKEN_DUMP_DROPPED,
    TOKEN_DUMP_WRITTEN,
    TOKEN_WEIGHTS_KEY,
    TOOL_MASK_BEFORE_RULES_KEY,
    rule_metric,
)
from .resume import EpochSeededSampler, resolve_resume_checkpoint
from .rewards import resolve_reward_funcs
from .token_rules import STAREController, apply_token_rules
from .trl_seams import GRPOSeams, get_config_model_id

logger = logging.getLogger(__name__)


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


class STAPOTrainer(GRPOSeams):
    """Spurious-Token-Aware Policy Optimization: GRPO/DAPO with the S2T mask (STAPO, Algorithm 1).

    Takes every argument of [`~trl.GRPOTrainer`]; `args` should be a [`STAPOConfig`] (a `GRPOConfig` is converted,
    keeping its values).

    At the start of each optimizer step, the tokens of all its micro-batches, across processes, form one pool. A token
    of a positive-advantage response with `p < prob_threshold` is a candidate; candidates whose entropy is below the
    `entropy_quantile`-th quantile of the candidates' entropies are silenced, and the loss is renormalized over the
    kept tokens (see the module docstring for how).

    The S2T mask is the first of the token rules (`args.active_token_rules`): S2T (`use_s2t_mask`), then STARE
    (`use_stare`), then your own registered `token_rules`, each seeing the tokens the rules before it kept. STARE's
    gate and weights live in a [`~stapo_trl.token_rules.STAREController`] (`self.stare_controller`), updated once per
    generation from the batch's mean token entropy under the generating policy, saved with each checkpoint
    (`stare_controller_state.json`) and restored by `resume_from_checkpoint`.

    Where `p` and `H` come from (`token_stats_source`):

    - `"generation"` (default): the policy that generated the batch. When TRL already runs its old-log-prob pass
      (vLLM importance-sampling correction, or `num_iterations > 1`, or misaligned accumulation) the statistics are
      taken from that pass; on TRL's `generate()` path they are recorded while sampling (a hook on the LM head, see
      `stapo_trl.fused_stats.generation`); otherwise one no-grad pass runs per generation (`generation_stats_blocker`
      says why). Only that last case costs a forward, and it runs with dropout off and leaves the random streams
      untouched. When every generation feeds exactly one optimizer step
      (`steps_per_generation == gradient_accumulation_steps`, `num_iterations == 1`) that policy *is* the policy
      being optimized, so the mask equals the loss-time mask. Otherwise the statistics are stale by at most
      `steps_per_generation / gradient_accumulation_steps * num_iterations - 1` updates.
    - `"loss"`: the policy being optimized in the step, as in the paper. A no-grad pass over the step's micro-batches
      runs when the step starts, except in the first step after a generation whose statistics already exist.

    Evaluation losses are reported without the mask: S2T changes training gradients only.

    With `dump_silenced_tokens`, each step's silenced tokens (text, context, `p`, `H`, advantage) go to
    `output_dir/silenced_tokens.jsonl`, bounded and sampled (see [`~stapo_trl.diagnostics.SilencedTokenDump`]). The
    model card ([`create_model_card`], written by TRL on checkpoint saves and `push_to_hub`) adds the method, its
    thresholds, the final token-rule statistics, evaluation results and the recipe to TRL's card.
    """

    card_name = "STAPO"
    card_tags = ("trl", "grpo", "stapo")
    card_paper = {"title": PAPER_TITLE, "id": PAPER_ID, "citation": STAPO_CITATION}

    # (log_probs, entropies) of every `_get_per_token_logps_and_entropies` call during a training generation, or None.
    _captured_token_stats: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    # The recorder of the training generation under way, and how many generate() calls it has seen.
    _generation_recorder: GenerationStatsRecorder | None = None
    _generation_calls: int = 0
    token_stats_origin: str | None = None
    """Where the last training generation's p and H came from: ``"trl_pass"`` (TRL's old-log-prob pass),
    ``"generate"`` (recorded while sampling), ``"statistics_pass"`` (STAPO's own no-grad pass) or ``"deferred"`` (the
    ``"loss"`` source computes them when the step starts)."""

    def __init__(self, model, reward_funcs=None, args: STAPOConfig | None = None, *positional, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = STAPOConfig(f"{model_name.split('/')[-1]}-STAPO")
        elif not isinstance(args, STAPOConfig):
            args = _as_stapo_config(args)
        reward_funcs = resolve_reward_funcs(reward_funcs)
        given = inspect.signature(super().__init__).bind_partial(model, reward_funcs, args, *positional, **kwargs)
        given = given.arguments
        _check_prompt_column(given.get("train_dataset"), given.get("environment_factory"))
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._generation_global_step: int | None = None
        self.token_rules = args.active_token_rules
        self.token_stats_backend = self._resolve_token_stats_backend() if self.token_rules else None
        self.stare_controller = (
            STAREController(
                target_entropy=args.stare_target_entropy,
                positive_weight=args.stare_positive_weight,
                negative_weight=args.stare_negative_weight,
                adaptive=args.stare_adaptive,
                alpha=args.stare_alpha,
                max_positive_weight=args.stare_max_positive_weight,
                min_negative_weight=args.stare_min_negative_weight,
                gate_mode=args.stare_gate,
            )
            if args.use_stare
            else None
        )
        self.token_dump = (
            SilencedTokenDump(
                args.output_dir,
                getattr(self.processing_class, "tokenizer", self.processing_class),
                tokens_per_step=args.dump_tokens_per_step,
                max_tokens=args.dump_max_tokens,
                context_tokens=args.dump_context_tokens,
                seed=args.seed,
                prob_threshold=args.prob_threshold if args.use_s2t_mask else None,
                is_main_process=self.accelerator.is_main_process,
            )
            if args.dump_silenced_tokens and self.token_rules
            else None
        )

    # ------------------------------------------------------------------ statistics
    def _resolve_token_stats_backend(self) -> str:
        return policy_stats.resolve_token_stats_backend(self)

    def per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        capture = self._captured_token_stats is not None and not self._is_reference_forward(model)
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
            self._captured_token_stats.append((logps, entropies))
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
        from peft.tuners.tuners_utils import BaseTunerLayer

        return any(isinstance(module, BaseTunerLayer) and module.disable_adapters for module in unwrapped.modules())

    def compute_token_stats(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(log_probs, entropies)`` ``[B, C]`` of the completions in a TRL batch under the current policy.

        Runs without gradients, with dropout off and the random streams untouched, in chunks of
        ``per_device_train_batch_size`` sequences, with the configured ``token_stats_backend``. Padding positions get
        0 (see `stapo_trl.policy_stats`).
        """
        return policy_stats.compute_token_stats(self, batch)

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
        transforms = policy_stats.logit_transforms(policy_stats.policy_parts(self)[0])
        if transforms:
            return f"the model transforms its logits after the LM head ({', '.join(transforms)})"
        sharding = policy_stats.sharding(self)
        if sharding is not None:
            return f"{sharding} shards the LM head"
        return None

    def generate_single_turn(self, prompt_ids, *args, **kwargs):
        recorder = self._generation_recorder
        self._generation_calls += 1
        if recorder is None or self._generation_calls > 1:
            return super().generate_single_turn(prompt_ids, *args, **kwargs)
        base, _, lm_head = policy_stats.policy_parts(self)
        with recorder.attached(base, lm_head):
            completion_ids, logprobs = super().generate_single_turn(prompt_ids, *args, **kwargs)
        return completion_ids, logprobs

    def _recorded_stats(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The recorded statistics aligned with ``output["completion_ids"]``, padding set to 0, or None."""
        recorder = self._generation_recorder
        if recorder is None or self._generation_calls != 1:
            return None
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        recorded = recorder.finish(completion_ids)
        if recorded is None:
            return None
        keep = completion_mask.bool()
        log_probs, entropies = (values.to(completion_ids.device).masked_fill(~keep, 0.0) for values in recorded)
        return log_probs, entropies

    def generate_and_score_completions(self, inputs):
        collect = bool(self.token_rules) and self.model.training
        self._captured_token_stats = [] if collect else None
        self._generation_calls = 0
        self._generation_recorder = (
            GenerationStatsRecorder(self.temperature) if collect and self.generation_stats_blocker() is None else None
        )
        try:
            output = super().generate_and_score_completions(inputs)
            recorded = self._recorded_stats(output) if collect else None
        finally:
            captured, self._captured_token_stats = self._captured_token_stats, None
            self._generation_recorder = None
        if not collect:
            return output

        old_log_probs = output.get("old_per_token_logps")
        stats = next((pair for pair in captured if old_log_probs is not None and pair[0] is old_log_probs), None)
        origin = "trl_pass" if stats is not None else None
        if stats is None and recorded is not None:
            stats, origin = recorded, "generate"
        # STARE's gate reads the generating policy's entropy, so it needs generation-time statistics either way.
        if stats is None and (self.args.token_stats_source == "generation" or self.stare_controller is not None):
            stats, origin = self.compute_token_stats(output), "statistics_pass"
        self.token_stats_origin = origin or "deferred"
        if stats is not None:
            output[LOG_PROBS_KEY], output[ENTROPIES_KEY] = stats
        output[TOOL_MASK_BEFORE_RULES_KEY] = output.get("tool_mask")
        output[NUM_ITEMS_BEFORE_RULES_KEY] = output["num_items_in_batch"]
        output[ADVANTAGES_BEFORE_RULES_KEY] = output["advantages"]
        self._generation_global_step = self.state.global_step
        if self.stare_controller is not None:
            self.stare_controller.update(self._mean_token_entropy(output))
        return output

    @staticmethod
    def _loss_mask_before_rules(batch: dict[str, Any]) -> torch.Tensor:
        """The tokens TRL's loss counts before any token rule: completion tokens that are not tool output."""
        tool_mask = batch[TOOL_MASK_BEFORE_RULES_KEY]
        return batch["completion_mask"] if tool_mask is None else batch["completion_mask"] * tool_mask

    def _mean_token_entropy(self, batch: dict[str, Any]) -> float:
        """Mean entropy of the loss tokens of a generation batch, over all processes."""
        loss_mask = self._loss_mask_before_rules(batch).bool() & torch.isfinite(batch[ENTROPIES_KEY])
        entropies = batch[ENTROPIES_KEY].double()
        total, count = all_reduce_sum(torch.stack([entropies[loss_mask].sum(), loss_mask.sum().double()])).tolist()
        return total / count if count else float("nan")

    def on_optimizer_step_start(self, step_batches: list[dict[str, Any]]) -> None:
        if self.token_rules:
            self.apply_token_rules(step_batches)

    # ------------------------------------------------------------------ the token rules
    def token_rule_calls(self, step_batches: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """The ``(name, params)`` of each active rule for one optimizer step, in the order they apply."""
        calls = []
        for name in self.token_rules:
            if name == "s2t":
                params = {"prob_threshold": self.args.prob_threshold, "entropy_quantile": self.args.entropy_quantile}
            elif name == "stare":
                params = self._stare_params(step_batches)
            else:
                params = dict(self.args.token_rule_kwargs.get(name, {}))
            calls.append((name, params))
        return calls

    def _stare_params(self, step_batches: list[dict[str, Any]]) -> dict[str, Any]:
        controller = self.stare_controller
        params = {
            "variant": self.args.stare_variant,
            "top_surprisal_share": self.args.stare_top_surprisal_share,
            "positive_weight": controller.positive_weight,
            "negative_weight": controller.negative_weight,
            "gate_on": controller.gate_on,
        }
        if self.args.stare_selection_pool == "micro_batch":
            sizes = [batch["completion_ids"].size(0) for batch in step_batches]
            device = step_batches[0]["completion_ids"].device
            params["groups"] = torch.repeat_interleave(
                torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device)
            )
            params["across_processes"] = False
            params["reduce_statistics"] = True
        return params

    def apply_token_rules(self, step_batches: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
        """Apply the active token rules to the micro-batches of one optimizer step, in place, and log their statistics.

        On each micro-batch this sets ``tool_mask`` (the tool mask before the rules times the keep-mask),
        ``num_items_in_batch`` (TRL's count minus the silenced tokens, scaled as TRL scales it) and ``advantages`` (the
        generation's advantages times the weights, ``[B, T]``, when a rule weights a token other than 1), plus
        ``stapo_silenced`` and ``stapo_token_weights`` for diagnostics. Returns each rule's statistics by rule name.
        """
        stale = self.state.global_step != self._generation_global_step
        for batch in step_batches:
            if LOG_PROBS_KEY not in batch or (self.args.token_stats_source == "loss" and stale):
                batch[LOG_PROBS_KEY], batch[ENTROPIES_KEY] = self.compute_token_stats(batch)

        loss_mask = torch.cat([self._loss_mask_before_rules(batch) for batch in step_batches]).bool()
        log_probs = torch.cat([batch[LOG_PROBS_KEY] for batch in step_batches])
        entropies = torch.cat([batch[ENTROPIES_KEY] for batch in step_batches])
        unweighted_advantages = torch.cat([batch[ADVANTAGES_BEFORE_RULES_KEY] for batch in step_batches])
        composed = apply_token_rules(
            self.token_rule_calls(step_batches), log_probs, entropies, unweighted_advantages, loss_mask
        )
        silenced = loss_mask & ~composed.keep
        num_silenced = int(all_reduce_sum(silenced.sum().reshape(1))[0])
        if self.token_dump is not None:
            dumped = self.token_dump.record_step(
                self.state.global_step + 1,
                StepTokens(
                    completion_ids=torch.cat([batch["completion_ids"] for batch in step_batches]),
                    log_probs=log_probs,
                    entropies=entropies,
                    advantages=unweighted_advantages,
                    loss_mask=loss_mask,
                    silenced=silenced,
                ),
            )
            self.log_metric(TOKEN_DUMP_WRITTEN, dumped["written"])
            self.log_metric(TOKEN_DUMP_DROPPED, dumped["dropped"])

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
        weights = composed.weights
        if weights is not None and bool((weights == 1).all()):
            weights = None
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
                advantages = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1)) * batch_weights
            batch["advantages"] = advantages
            batch[SILENCED_KEY] = batch_silenced
            batch[TOKEN_WEIGHTS_KEY] = batch_weights
        self._log_token_rule_stats(composed.stats)
        return composed.stats

    def _log_token_rule_stats(self, stats: dict[str, dict[str, float | int]]) -> None:
        for rule, rule_stats in stats.items():
            for key, value in rule_stats.items():
                self.log_metric(rule_metric(rule, key), value)
        if self.stare_controller is not None:
            self.log_metric(STARE_POSITIVE_WEIGHT, self.stare_controller.positive_weight)
            self.log_metric(STARE_NEGATIVE_WEIGHT, self.stare_controller.negative_weight)
            self.log_metric(STARE_BATCH_ENTROPY, self.stare_controller.batch_entropy)

    # ------------------------------------------------------------------ model card
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card (quick start, framework versions, citations) plus the STAPO sections: the method and its
        thresholds, the final token-rule statistics, the evaluation results found in ``output_dir``
        (``run_summary.json``, ``*/summary.json`` of `stapo-trl eval`) and the recipe. TRL calls this on every
        checkpoint save and on `push_to_hub`."""
        from .methods import infer_method

        tags = [tags] if isinstance(tags, str) else list(tags or [])
        method = infer_method(self.args)
        if method not in tags:
            tags.append(method)
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        card = Path(self.args.output_dir) / "README.md"
        if not self.is_world_process_zero() or not card.is_file():
            return
        card.write_text(
            fill_trl_nones(
                card.read_text(encoding="utf-8"), get_config_model_id(self.model.config), str(self.args.output_dir)
            ),
            encoding="utf-8",
        )
        write_card_sections(card, self.args, self.state.log_history, self.args.output_dir)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (see `stapo_trl.resume`): ``True``,
        ``"true"`` or ``"last"`` pick the newest complete one, and an interrupted one is refused."""
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(checkpoint, *args, **kwargs)

    def wrap_train_sampler(self, sampler):
        """TRL's sampler, moved to each epoch's shuffle on `set_epoch`, so a resumed run sees the same prompts."""
        return EpochSeededSampler(sampler)

    def save_extra_state(self, output_dir):
        """Save the STARE controller and the dump with the optimizer, so both are on disk before transformers writes
        ``trainer_state.json``, the file that marks a checkpoint complete."""
        if not self.args.should_save:
            return
        if self.stare_controller is not None:
            self.stare_controller.save_to(output_dir)
        if self.token_dump is not None:
            self.token_dump.save_state(output_dir)

    def load_extra_state(self, checkpoint):
        if self.token_dump is not None and not self.token_dump.load_state(checkpoint):
            logger.warning(
                "Resuming from %s, which holds no silenced-token dump state; %s starts over.",
                checkpoint,
                self.token_dump.records_path,
            )
        if self.stare_controller is not None:
            self.stare_controller.restore_from(checkpoint)
