"""The seams between the core and TRL 1.16: the hooks `STAPOTrainer` overrides, over TRL's private methods
(`HookedGRPOTrainer`), and the TRL helpers the core uses. Every assumption they make is one `Seam` in
`stapo_trl.trl_boundary.drift_checks`; the helpers the layers above use are in `stapo_trl.trl_boundary.helpers`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, get_config_model_id, maybe_gather_lm_head_ctx

__all__ = [
    "HookedGRPOTrainer",
    "StepEventCallback",
    "disable_gradient_checkpointing",
    "get_config_model_id",
    "maybe_gather_lm_head_ctx",
    "reseed_repeat_sampler",
]


class StepEventCallback(TrainerCallback):
    """A `TrainerCallback` that also receives the moments only `STAPOTrainer`'s step sees. Pass it in ``callbacks`` as
    any callback; the trainer calls each method on every such callback, in the order they were added. Every method
    does nothing by default; ``trainer`` is the `STAPOTrainer` (log with ``trainer.log_metric``)."""

    def on_generation_scored(self, trainer, batch: dict[str, Any], rewards: torch.Tensor | None) -> None:
        """A training generation was sampled and scored on this process, and its p and H taken: ``batch`` is TRL's
        output before it is shuffled and split into micro-batches (a tensor added to it, batch-first, reaches them);
        ``rewards`` is ``[completions, reward functions]`` (NaN where a function returned None)."""

    def on_step_tokens(self, trainer, step_batches: list[dict[str, Any]], tokens) -> None:
        """The token rules ran on an optimizer step, before its first micro-batch's loss: ``step_batches`` are its
        micro-batches as TRL's loss will read them, ``tokens`` their `StepTokens` (rows concatenated), with the
        silenced tokens. Called only in runs with a token rule on or in shadow."""

    def on_micro_batch(self, trainer, batch: dict[str, Any]) -> None:
        """TRL's loss is about to run on a training micro-batch: the random state now is the one its dropout draws
        from (nothing draws random numbers in between in TRL 1.16)."""

    def on_save_state(self, trainer, checkpoint_dir: str) -> None:
        """A checkpoint is being saved: write files into ``checkpoint_dir`` before ``trainer_state.json`` marks it
        complete."""

    def on_load_state(self, trainer, checkpoint_dir: str) -> None:
        """Training resumes from ``checkpoint_dir``: read what `on_save_state` wrote there."""

    def on_model_card(self, trainer, card_path, *, model_name: str | None, dataset_name: str | None) -> None:
        """The trainer wrote its model card to ``card_path`` (on each checkpoint save and on ``push_to_hub``, on the
        main process), given ``model_name`` and ``dataset_name`` as TRL's ``create_model_card`` is."""


class HookedGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with the private methods stapo-trl extends turned into public hooks.

    Each hook's default is TRL's own behaviour; a subclass overrides the hook and calls ``super()`` for TRL's part.
    The model card's trainer name, tags and paper are the public class attributes `card_name`, `card_tags` and
    `card_paper`.
    """

    card_name: str = "GRPO"
    card_tags: tuple[str, ...] = ("trl", "grpo")
    card_paper: dict[str, str] = {}
    _micro_batches_as_given = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._name, cls._tag_names = cls.card_name, list(cls.card_tags)
        if cls.card_paper:
            cls._paper = dict(cls.card_paper)

    # --- hooks over TRL's private methods
    def per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """TRL's ``_get_per_token_logps_and_entropies``: ``(log_probs, entropies or None, aux_loss)`` of the last
        ``logits_to_keep`` positions. TRL calls it for the loss, the old-log-prob pass and the reference pass."""
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
        )

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self.per_token_logps_and_entropies(*args, **kwargs)

    def generate_and_score_completions(self, inputs) -> dict[str, Any]:
        """TRL's ``_generate_and_score_completions``: sample, score and compute advantages for one generation batch."""
        return super()._generate_and_score_completions(inputs)

    def _generate_and_score_completions(self, inputs):
        return self.generate_and_score_completions(inputs)

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """TRL's ``_calculate_rewards``: the ``[completions, reward functions]`` rewards of this process's completions
        (NaN where a function returned None), before they are gathered across processes."""
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self.calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def generate_single_turn(self, prompt_ids, *args, **kwargs) -> tuple[Any, Any]:
        """TRL's ``_generate_single_turn``: one round of sampling, ``(completion_ids, logprobs)``."""
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        return self.generate_single_turn(prompt_ids, *args, **kwargs)

    def on_optimizer_step_start(self, step_batches: list[dict[str, Any]]) -> None:
        """Called in training before the first micro-batch of each optimizer step, with the step's micro-batches (TRL's
        buffered dicts, which its loss reads later: a change made here reaches the loss). Does nothing by default."""

    def on_training_micro_batch(self, inputs: dict[str, Any]) -> None:
        """Called in training right before TRL's loss runs on each micro-batch (after `on_optimizer_step_start` for the
        first micro-batch of a step). In TRL 1.16 nothing draws random numbers between this call and the loss's
        forward, so the random state here is the one its dropout starts from (the counterfactual replay relies on it;
        tests/unit/test_counterfactual.py checks it). Does nothing by default."""

    @contextmanager
    def micro_batches_as_given(self):
        """Within, ``training_step(model, batch)`` runs TRL's loss on ``batch`` as it is: no generation, no buffer, no
        hooks (`stapo_trl.research.counterfactual.replay` applies saved optimizer steps with it)."""
        self._micro_batches_as_given = True
        try:
            yield
        finally:
            self._micro_batches_as_given = False

    def _prepare_inputs(self, generation_batch):
        if self._micro_batches_as_given:
            return generation_batch
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            accumulation = self.args.gradient_accumulation_steps
            index = self._step % self.args.steps_per_generation
            if index % accumulation == 0:
                self.on_optimizer_step_start(self._buffered_inputs[index : index + accumulation])
            self.on_training_micro_batch(inputs)
        return inputs

    def wrap_train_sampler(self, sampler):
        """The training sampler to use in place of TRL's (a ``RepeatSampler``); TRL's by default."""
        return sampler

    def _get_train_sampler(self, dataset=None):
        return self.wrap_train_sampler(super()._get_train_sampler(dataset))

    def save_extra_state(self, output_dir: str) -> None:
        """Write extra checkpoint files: called after the optimizer is saved and before ``trainer_state.json``, the
        file that marks a checkpoint complete."""

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        self.save_extra_state(output_dir)

    def load_extra_state(self, checkpoint: str) -> None:
        """Read what `save_extra_state` wrote, when training resumes from ``checkpoint``."""

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_extra_state(checkpoint)

    # --- TRL's private state
    def log_metric(self, name: str, value: float, mode: str = "train") -> None:
        """Add a value to the metric ``name``: TRL averages each metric's values (NaN skipped) at the next log."""
        self._metrics[mode][name].append(value)

    @contextmanager
    def metrics_untouched(self):
        """Run TRL code (its loss, for a measurement) whose metrics must not be logged: on exit every metric holds
        the values it held on entry, and metrics that appeared inside are gone."""
        before = {
            mode: {name: len(values) for name, values in metrics.items()} for mode, metrics in self._metrics.items()
        }
        try:
            yield
        finally:
            for mode, metrics in self._metrics.items():
                for name in list(metrics):
                    kept = before.get(mode, {}).get(name)
                    if kept is None:
                        del metrics[name]
                    else:
                        del metrics[name][kept:]

    @property
    def is_vision_language_model(self) -> bool:
        """Whether TRL treats the model as a vision-language model (its ``_is_vlm``)."""
        return self._is_vlm


def reseed_repeat_sampler(sampler: RepeatSampler, epoch: int) -> None:
    """Move a shuffling, seeded ``RepeatSampler`` to epoch ``epoch``'s permutation: reseed its generator and draw the
    permutations of the epochs before (TRL draws one ``torch.randperm`` per pass). Others are left alone."""
    if not getattr(sampler, "shuffle", False) or getattr(sampler, "seed", None) is None:
        return
    sampler.generator.manual_seed(sampler.seed)
    for _ in range(epoch):
        torch.randperm(sampler.num_samples, generator=sampler.generator)
