"""The hooks `STAPOTrainer` overrides, over TRL 1.16's private methods (`HookedGRPOTrainer`), and the small helpers
that each touch one private name of TRL or transformers (a sampler's generator, the config's ``_name_or_path``, a vLLM
weight iterator, the decoder-layer loop) so that the rest of the package does not. Every assumption they make is one
`Seam` in `stapo_trl.trl_boundary.drift_checks`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PretrainedConfig, Trainer
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, get_config_model_id, maybe_gather_lm_head_ctx

__all__ = [
    "TRL_REWARD_COUNT_MESSAGE",
    "HookedGRPOTrainer",
    "decoder_layer_cache",
    "decoder_layers",
    "disable_gradient_checkpointing",
    "get_config_model_id",
    "iter_vllm_weights",
    "maybe_gather_lm_head_ctx",
    "reseed_repeat_sampler",
    "save_model_without_push",
    "set_model_name_or_path",
]

TRL_REWARD_COUNT_MESSAGE = "The reward function '"
"""How TRL's refusal of a reward function's output starts (it then names the function and the counts)."""


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
        hooks (`stapo_trl.counterfactual.replay` applies saved optimizer steps with it)."""
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


def save_model_without_push(trainer: Trainer, output_dir: str) -> None:
    """``trainer.save_model(output_dir)`` without the Hub push that transformers makes from it when ``push_to_hub``."""
    trainer.save_model(output_dir, _internal_call=True)


def iter_vllm_weights(generation) -> Any:
    """The ``(name, tensor)`` pairs TRL's `VLLMGeneration` pushes into vLLM on a weight sync, one at a time, under
    vLLM's names: PEFT adapters merged, ZeRO-3 and FSDP shards gathered (its ``_iter_named_params``). A generator: the
    gathering and the adapter merge last until it is exhausted."""
    return generation._iter_named_params()


def set_model_name_or_path(config: PretrainedConfig, name: str) -> None:
    """Set the name transformers and TRL's model card read as the model's source (the config's ``_name_or_path``)."""
    config._name_or_path = name


def missing(source: str, *needles: str) -> list[str]:
    """A problem for each of ``needles`` that ``source`` no longer contains."""
    return [f"no longer contains {needle!r}" for needle in needles if needle not in source]


DECODER_LOOP = ("decoder_layer in", "self.layers[: self.config.num_hidden_layers]", "hidden_states = decoder_layer(")
"""How transformers' decoder-only backbones run their layers: each layer takes the hidden states first and returns the
next ones as a tensor."""


DECODER_CACHE_ARGUMENT = "cache"
"""The keyword under which transformers' decoder layers receive the KV cache (``past_key_values`` before 5.x)."""


def decoder_layer_cache(layer_kwargs: dict[str, Any]) -> Any:
    """The KV cache a decoder layer was called with, when it is one whose per-layer entries can be re-indexed along
    the batch (a transformers ``Cache`` of layers with ``reorder_cache``, not offloaded); otherwise None."""
    cache = layer_kwargs.get(DECODER_CACHE_ARGUMENT)
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        return None
    return cache


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.ModuleList | None, list[str]]:
    """The decoder layers of a transformers causal LM's backbone (``model.base_model.layers``), when its forward runs
    them as `DECODER_LOOP` says, so that swapping a layer module for another that keeps that call and return changes
    what the loop computes; otherwise ``(None, why not)``."""
    backbone = getattr(model, "base_model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None, [f"{type(model).__name__} has no decoder layer list at base_model.layers"]
    label = f"{type(backbone).__name__}.forward"
    try:
        source = inspect.getsource(type(backbone).forward)
    except (OSError, TypeError):
        return None, [f"{label} has no readable source"]
    problems = [f"{label} {problem}" for problem in missing(source, *DECODER_LOOP)]
    return (None, problems) if problems else (layers, [])
