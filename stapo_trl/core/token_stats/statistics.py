"""Where the per-token ``(log p, H)`` the token rules read come from (`TokenStatistics.origin`): TRL's old-log-prob
pass with entropy on (``"trl_pass"``), a recording of `generate()` (``"generate"``), one no-grad pass
(``"statistics_pass"``), or none yet (``"deferred"``, with ``token_stats_source="loss"``). docs/semantics.md says when.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.utils import is_peft_model
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..names import ENTROPIES_KEY, LOG_PROBS_KEY
from ..trl_seams import disable_gradient_checkpointing, maybe_gather_lm_head_ctx
from .backends import TRL_FUSED_HEAD, resolve_backend, token_logprob_entropy
from .generation import GenerationStatsRecorder

TOKEN_STATS_SOURCES = ("generation", "loss")

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
"""Batch keys that TRL's per-token pass takes for vision-language inputs."""
LOGIT_TRANSFORM_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)
"""Config attributes with which TRL's fused head rescales or soft-caps logits; the other backends do neither."""


def sharding(is_fsdp_enabled: bool) -> str | None:
    """Why the LM head may be sharded outside its module's forward (FSDP, ZeRO-3), or None."""
    if is_fsdp_enabled:
        return "FSDP"
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3"
    return None


@contextmanager
def restored_random_streams():
    """Restore torch's (CPU and current CUDA device), NumPy's and Python's random streams on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextmanager
def side_effect_free_pass(model: torch.nn.Module):
    """Run a forward that changes nothing but its result: dropout off (every module in eval mode, each module's mode
    restored afterwards), and the random streams restored (`restored_random_streams`), so that the training run draws
    the same numbers with or without this pass."""
    modes = [(module, module.training) for module in model.modules()]
    with restored_random_streams():
        model.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training


ModelHeadPass = Callable[..., tuple[torch.Tensor, torch.Tensor | None, Any]]
"""TRL's per-token pass: ``(model, input_ids, attention_mask, logits_to_keep, batch_size=, compute_entropy=, **mm)``
returning ``(log_probs, entropies, aux)``."""


@dataclass
class _Generation:
    """What one training generation has gathered so far."""

    captured: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    recorder: GenerationStatsRecorder | None = None
    generate_calls: int = 0


class TokenStatistics:
    """Per-token ``(log p, H)`` of a trainer's completions, from wherever they are cheapest, written into each
    generation batch under ``stapo_log_probs`` and ``stapo_entropies``. ``get_model`` returns the model as the trainer
    holds it now; ``model_head_pass`` is TRL's per-token pass (the ``trl_fused_head`` backend); ``vision_language`` and
    ``fsdp`` decide what ``"auto"`` resolves to; ``generation_statistics_required`` takes p and H at generation time
    even with ``source="loss"``.
    """

    def __init__(
        self,
        *,
        source: str,
        backend: str,
        temperature: float,
        chunk_size: int,
        get_model: Callable[[], torch.nn.Module],
        accelerator,
        model_head_pass: ModelHeadPass,
        gradient_checkpointing_kwargs: dict | None = None,
        vision_language: bool = False,
        fsdp: bool = False,
        generation_statistics_required: bool = False,
    ):
        self.source = source
        self.temperature = temperature
        self.chunk_size = chunk_size
        self._get_model = get_model
        self._accelerator = accelerator
        self._model_head_pass = model_head_pass
        self._gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        self.generation_statistics_required = generation_statistics_required
        self.sharded_by = sharding(fsdp)
        self._unwrapped: tuple[torch.nn.Module, Any] | None = None
        base, _, lm_head = self.policy_parts()
        text_config = base.config.get_text_config()
        transforms = [name for name in LOGIT_TRANSFORM_ATTRIBUTES if getattr(text_config, name, None) is not None]
        self.logit_transforms = transforms
        """The attributes of the model's text config that transform logits after the LM head."""
        not_covered = transforms + (["vision-language inputs"] if vision_language else [])
        self.backend = resolve_backend(
            backend,
            accelerator.device,
            has_bias=lm_head.bias is not None,
            not_covered=not_covered,
            sharded_by=self.sharded_by,
            option="token_stats_backend",
        )
        self.origin: str | None = None
        """Where the last training generation's statistics came from (the module docstring names the four)."""
        self.generation_step: int | None = None
        """The optimizer steps completed when the last training generation's statistics were taken."""
        self._generation: _Generation | None = None

    def policy_parts(self) -> tuple[Any, Any, torch.nn.Module]:
        """The transformers model under any DDP/PEFT wrapping, its backbone and its LM head.

        The unwrapping is done once per model object the trainer holds (that object changes when training wraps the
        model): accelerate's unwrapping and PEFT check look up package metadata and walk every module, and this runs at
        every training generation."""
        model = self._get_model()
        if self._unwrapped is None or self._unwrapped[0] is not model:
            unwrapped = self._accelerator.unwrap_model(model)
            self._unwrapped = (model, unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped)
        base = self._unwrapped[1]
        return base, base.base_model, base.get_output_embeddings()

    # ------------------------------------------------------------------ one training generation
    def begin_generation(self, *, record_generate: bool) -> None:
        """Start gathering statistics for a training generation; ``record_generate`` says whether TRL's `generate()`
        path may be recorded (the trainer knows why not: vLLM, beam search, tools, ...)."""
        self._generation = _Generation(recorder=GenerationStatsRecorder(self.temperature) if record_generate else None)

    @property
    def is_gathering(self) -> bool:
        return self._generation is not None

    def capture(self, log_probs: torch.Tensor, entropies: torch.Tensor | None) -> None:
        """Keep one result of TRL's per-token pass made during the generation (the old-log-prob pass among them)."""
        if self._generation is not None:
            self._generation.captured.append((log_probs, entropies))

    def recording_generate(self):
        """A context for one TRL `generate()` call: the first call of a generation is recorded; later ones (tool
        turns) make the recording unusable and are not hooked."""
        generation = self._generation
        if generation is None:
            return nullcontext()
        generation.generate_calls += 1
        if generation.recorder is None or generation.generate_calls > 1:
            return nullcontext()
        base, _, lm_head = self.policy_parts()
        return generation.recorder.attached(base, lm_head)

    def finish_generation(self, output: dict[str, Any], global_step: int) -> None:
        """Write the generation's ``(log p, H)`` into ``output`` (TRL's generation batch), computing them with the
        statistics pass when neither TRL's pass nor the recording gave them and they are needed now, and set
        :attr:`origin`."""
        generation, self._generation = self._generation, None
        if generation is None:
            return
        stats, origin = None, "deferred"
        old_log_probs = output.get("old_per_token_logps")
        if old_log_probs is not None:
            stats = next((pair for pair in generation.captured if pair[0] is old_log_probs), None)
            origin = "trl_pass" if stats is not None else origin
        if stats is None and generation.recorder is not None and generation.generate_calls == 1:
            stats = self._recorded(generation.recorder, output)
            origin = "generate" if stats is not None else origin
        if stats is None and (self.source == "generation" or self.generation_statistics_required):
            stats, origin = self.compute(output), "statistics_pass"
        self.origin = origin
        self.generation_step = global_step
        if stats is not None:
            output[LOG_PROBS_KEY], output[ENTROPIES_KEY] = stats

    def abandon_generation(self) -> None:
        """Drop what a generation that raised had gathered."""
        self._generation = None

    @staticmethod
    def _recorded(recorder: GenerationStatsRecorder, output: dict[str, Any]):
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        recorded = recorder.finish(completion_ids)
        if recorded is None:
            return None
        keep = completion_mask.bool()
        return tuple(values.to(completion_ids.device).masked_fill(~keep, 0.0) for values in recorded)

    # ------------------------------------------------------------------ one optimizer step
    def ensure_for_step(self, step_batches: list[dict[str, Any]], global_step: int) -> None:
        """Make sure every micro-batch of an optimizer step holds ``(log p, H)`` of the policy ``source`` names: with
        ``"loss"``, recomputed unless the generation's statistics were taken at this very step."""
        stale = global_step != self.generation_step
        for batch in step_batches:
            if LOG_PROBS_KEY not in batch or (self.source == "loss" and stale):
                batch[LOG_PROBS_KEY], batch[ENTROPIES_KEY] = self.compute(batch)

    @torch.no_grad()
    def compute(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(log_probs, entropies)`` ``[B, C]`` of the completions in a TRL batch under the current policy,
        with the resolved backend, in chunks of ``chunk_size`` sequences. Padding positions get 0."""
        model = self._get_model()
        with side_effect_free_pass(model):
            return self._forward(model, batch)

    def _forward(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        completion_mask = batch["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        chunk = self.chunk_size

        with disable_gradient_checkpointing(model, self._gradient_checkpointing_kwargs):
            if self.backend == TRL_FUSED_HEAD:
                multimodal = {key: batch[key] for key in MULTIMODAL_KEYS if batch.get(key) is not None}
                log_probs, entropies, _ = self._model_head_pass(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=chunk,
                    compute_entropy=True,
                    **multimodal,
                )
                return log_probs, entropies

            _, backbone, lm_head = self.policy_parts()
            weight, bias = lm_head.weight, lm_head.bias
            if hasattr(weight, "full_tensor"):  # FSDP2 shards parameters as DTensors
                weight = weight.full_tensor()
                bias = None if bias is None else bias.full_tensor()
            targets = completion_ids.masked_fill(completion_mask == 0, -100)
            log_probs, entropies = [], []
            for start in range(0, input_ids.size(0), chunk):
                end = start + chunk
                with self._accelerator.autocast():
                    hidden = backbone(
                        input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], use_cache=False
                    ).last_hidden_state
                # The hidden state at position j predicts token j + 1.
                hidden = hidden[:, -logits_to_keep - 1 : -1].to(weight.device)
                with maybe_gather_lm_head_ctx(weight, bias):
                    chunk_log_probs, chunk_entropies = token_logprob_entropy(
                        hidden,
                        weight,
                        targets[start:end].to(weight.device),
                        bias=bias,
                        temperature=self.temperature,
                        backend=self.backend,
                    )
                log_probs.append(chunk_log_probs.float())
                entropies.append(chunk_entropies.float())
        device = completion_ids.device
        return torch.cat(log_probs).to(device), torch.cat(entropies).to(device)
