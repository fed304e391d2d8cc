"""The seam between stapo-trl and the internals of TRL 1.16 and transformers.

This is the only module that names a private method or attribute of TRL or transformers (a test scans the package to
keep it so), and the only one that imports TRL's internal helpers. Everything else uses the public hooks of
`GRPOSeams` and the functions below.

Each touch point is one `Seam` in `SEAMS`: what TRL 1.16 does there, what stapo-trl relies on, and a `check` that
reads the installed TRL and transformers and lists what no longer fits. `tests/repository/test_trl_seams.py` runs
every check; ``python -m stapo_trl.trl_seams`` prints them, which is where a port to a new TRL starts.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import trl.trainer.utils as trl_trainer_utils
from transformers import PretrainedConfig, Trainer
from trl import GRPOTrainer
from trl.kernels import ChunkedLogProbFunction
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, add_fused_lm_head, get_config_model_id, maybe_gather_lm_head_ctx

TESTED_TRL = "1.16"

__all__ = [
    "SEAMS",
    "TRL_REWARD_COUNT_MESSAGE",
    "GRPOSeams",
    "Seam",
    "disable_gradient_checkpointing",
    "decoder_layer_cache",
    "decoder_layers",
    "fused_head_op",
    "get_config_model_id",
    "iter_vllm_weights",
    "install_fused_head_op",
    "maybe_gather_lm_head_ctx",
    "reseed_repeat_sampler",
    "save_model_without_push",
    "set_model_name_or_path",
]


class GRPOSeams(GRPOTrainer):
    """`GRPOTrainer` with the private methods stapo-trl extends turned into public hooks.

    Each hook's default is TRL's own behaviour; a subclass overrides the hook and calls ``super()`` for TRL's part.
    The model card's trainer name, tags and paper are the public class attributes `card_name`, `card_tags` and
    `card_paper`.
    """

    card_name: str = "GRPO"
    card_tags: tuple[str, ...] = ("trl", "grpo")
    card_paper: dict[str, str] = {}

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
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        return self.per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

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

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            accumulation = self.args.gradient_accumulation_steps
            index = self._step % self.args.steps_per_generation
            if index % accumulation == 0:
                self.on_optimizer_step_start(self._buffered_inputs[index : index + accumulation])
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


def fused_head_op() -> Any:
    """The op `add_fused_lm_head`'s forward calls for its per-token statistics: TRL's ``ChunkedLogProbFunction``
    unless `install_fused_head_op` replaced it."""
    return trl_trainer_utils._ChunkedLogProbFunction


def install_fused_head_op(op: Any) -> Callable[[], None]:
    """Make every model patched by `add_fused_lm_head` (now or before) call ``op.apply`` in place of TRL's
    ``ChunkedLogProbFunction.apply``, with the same arguments, and pass it only the labelled positions on the CPU, as
    TRL does on Triton devices (TRL's CPU path scores every position, prompt and padding included, and zeroes the
    unlabelled ones afterwards). Returns the function that puts both back.

    TRL's forward looks both names up in `trl.trainer.utils` at each call, so the swap reaches models patched before
    it; GPUs keep TRL's test, so only the CPU path changes."""
    previous_op, previous_compact = trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or previous_compact(device)

    trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = op, compact

    def restore() -> None:
        trl_trainer_utils._ChunkedLogProbFunction, trl_trainer_utils._use_triton = previous_op, previous_compact

    return restore


DECODER_LOOP = ("decoder_layer in", "self.layers[: self.config.num_hidden_layers]", "hidden_states = decoder_layer(")
"""How transformers' decoder-only backbones run their layers: each layer takes the hidden states first and returns the
next ones as a tensor."""


def _decoder_loop_problems(backbone_class: type) -> list[str]:
    try:
        source = _source(backbone_class.forward)
    except (OSError, TypeError):
        return [f"{backbone_class.__name__}.forward has no readable source"]
    return [f"{backbone_class.__name__}.forward {problem}" for problem in _missing(source, *DECODER_LOOP)]


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
    problems = _decoder_loop_problems(type(backbone))
    return (None, problems) if problems else (layers, [])


# --- the checks ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seam:
    """One touch point: what TRL 1.16 does there, what stapo-trl relies on, and a check of the installed version."""

    name: str
    trl_does: str
    we_rely_on: str
    check: Callable[[], list[str]]
    requires: str | None = None
    """A package the check reads besides TRL and transformers (``"vllm"``); without it the check cannot run."""

    def can_check(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def _source(function) -> str:
    return inspect.getsource(function)


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _missing(source: str, *needles: str) -> list[str]:
    return [f"no longer contains {needle!r}" for needle in needles if needle not in source]


def _check_per_token_logps() -> list[str]:
    problems = []
    expected = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"]
    found = _parameters(GRPOTrainer._get_per_token_logps_and_entropies)
    if found[:7] != expected:
        problems.append(f"_get_per_token_logps_and_entropies takes {found}, expected {expected} first")
    return problems + _missing(_source(GRPOTrainer._get_per_token_logps_and_entropies), "return logps, entropies")


def _check_generate_and_score() -> list[str]:
    problems = []
    if _parameters(GRPOTrainer._generate_and_score_completions) != ["self", "inputs"]:
        problems.append("_generate_and_score_completions no longer takes (self, inputs)")
    source = _source(GRPOTrainer._generate_and_score_completions)
    return problems + _missing(source, '"num_items_in_batch"', '"advantages"', '"completion_mask"', '"tool_mask"')


TRL_REWARD_COUNT_MESSAGE = "The reward function '"
"""How TRL's refusal of a reward function's output starts (it then names the function and the counts)."""


def _check_calculate_rewards() -> list[str]:
    problems = []
    if _parameters(GRPOTrainer._calculate_rewards) != [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]:
        problems.append("_calculate_rewards no longer takes (self, inputs, prompts, completions, completion_ids_list)")
    source = _source(GRPOTrainer._calculate_rewards)
    return problems + _missing(source, "return rewards_per_func", TRL_REWARD_COUNT_MESSAGE, "torch.nan")


def _check_generate_single_turn() -> list[str]:
    return _missing(_source(GRPOTrainer._generate_single_turn), "return completion_ids, logprobs")


def _check_prepare_inputs() -> list[str]:
    problems = _missing(
        _source(GRPOTrainer._prepare_inputs),
        "self._buffered_inputs = [",
        "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
    )
    training_step = _source(GRPOTrainer.training_step)
    step, increment = "super().training_step(model, inputs, num_items_in_batch)", "self._step += 1"
    if step not in training_step or increment not in training_step:
        problems.append("training_step no longer advances self._step by one per micro-batch")
    elif training_step.index(step) > training_step.index(increment):
        problems.append("training_step advances self._step before the micro-batch is trained")
    return problems


def _check_train_sampler() -> list[str]:
    problems = _missing(_source(GRPOTrainer._get_train_sampler), "RepeatSampler(")
    init, iterate = _source(RepeatSampler.__init__), _source(RepeatSampler.__iter__)
    problems += _missing(init, "self.shuffle =", "self.seed =", "self.generator =", "self.num_samples =")
    return problems + _missing(iterate, "torch.randperm(self.num_samples, generator=self.generator)")


def _check_checkpoint_state() -> list[str]:
    problems = []
    if _parameters(Trainer._save_optimizer_and_scheduler) != ["self", "output_dir"]:
        problems.append("Trainer._save_optimizer_and_scheduler no longer takes (self, output_dir)")
    if _parameters(Trainer._load_optimizer_and_scheduler) != ["self", "checkpoint"]:
        problems.append("Trainer._load_optimizer_and_scheduler no longer takes (self, checkpoint)")
    save = _source(Trainer._save_checkpoint)
    optimizer, state = "self._save_optimizer_and_scheduler(output_dir)", "self.state.save_to_json("
    if optimizer not in save or state not in save or save.index(optimizer) > save.index(state):
        problems.append("Trainer._save_checkpoint no longer saves the optimizer before trainer_state.json")
    return problems


def _check_metrics() -> list[str]:
    return _missing(_source(GRPOTrainer.__init__), 'self._metrics = {"train": defaultdict(list)')


def _check_is_vlm() -> list[str]:
    return _missing(_source(GRPOTrainer.__init__), "self._is_vlm = True", "self._is_vlm = False")


def _check_model_card() -> list[str]:
    names = ("_name", "_tag_names", "_paper")
    problems = [f"GRPOTrainer has no class attribute {name}" for name in names if not hasattr(GRPOTrainer, name)]
    return problems + _missing(_source(GRPOTrainer.create_model_card), "self._name", "self._paper", "self._tag_names")


def _check_save_model() -> list[str]:
    problems = []
    if _parameters(Trainer.save_model) != ["self", "output_dir", "_internal_call"]:
        problems.append("Trainer.save_model no longer takes (self, output_dir, _internal_call)")
    return problems + _missing(_source(Trainer.save_model), "if self.args.push_to_hub and not _internal_call:")


def _check_name_or_path() -> list[str]:
    return [] if "_name_or_path" in PretrainedConfig().to_dict() else ["PretrainedConfig has no _name_or_path"]


def _check_helpers() -> list[str]:
    expected = {
        disable_gradient_checkpointing: ["model", "gradient_checkpointing_kwargs"],
        get_config_model_id: ["config"],
        maybe_gather_lm_head_ctx: ["params"],
    }
    return [
        f"{helper.__name__} now takes {_parameters(helper)}, expected {parameters}"
        for helper, parameters in expected.items()
        if _parameters(helper) != parameters
    ]


# --- colocated vLLM on vLLM's CPU backend (stapo_trl.colocated_vllm_cpu) -------------------------------------------


def _vllm_generation_class():
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration


def _check_vllm_engine_construction() -> list[str]:
    import trl.generation.vllm_generation as trl_vllm_generation
    import trl.trainer.grpo_trainer as trl_grpo_trainer
    from trl import GRPOConfig

    generation = _vllm_generation_class()
    problems = []
    wanted = ["model", "mode", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode"]
    missing = [name for name in wanted if name not in _parameters(generation.__init__)]
    if missing:
        problems.append(f"VLLMGeneration.__init__ no longer takes {missing}")
    engine = _source(generation._init_vllm)
    problems += _missing(engine, "self.llm = LLM(", 'distributed_executor_backend="external_launcher"')
    problems += [
        f"VLLMGeneration._init_vllm now passes {keyword}, which the CPU adapter adds itself"
        for keyword in ("dtype=", "enforce_eager=", "kv_cache_memory_bytes=")
        if keyword in engine
    ]
    problems += _missing(inspect.getsource(trl_vllm_generation), "    from vllm import LLM, ")
    if getattr(trl_grpo_trainer, "VLLMGeneration", None) is not generation:
        problems.append("trl.trainer.grpo_trainer no longer imports VLLMGeneration by that name")
    problems += _missing(_source(GRPOTrainer.__init__), "self.vllm_generation = VLLMGeneration(")
    default = GRPOConfig.__dataclass_fields__["vllm_gpu_memory_utilization"].default
    if default != 0.3:
        problems.append(f"GRPOConfig.vllm_gpu_memory_utilization defaults to {default}, not 0.3")
    return problems


def _check_vllm_weight_sync() -> list[str]:
    generation = _vllm_generation_class()
    problems = _missing(
        _source(generation.sync_weights),
        "for name, param in self._iter_named_params():",
        "model_runner.model.load_weights([(name, param)])",
        "self.llm.reset_prefix_cache()",
    )
    if not inspect.isgeneratorfunction(generation._iter_named_params) or _parameters(
        generation._iter_named_params
    ) != ["self"]:
        problems.append("VLLMGeneration._iter_named_params is no longer a generator method without arguments")
    single_turn = _source(GRPOTrainer._generate_single_turn)
    problems += _missing(
        single_turn, "if self.state.global_step != self._last_loaded_step:", "self.vllm_generation.sync_weights()"
    )
    return problems


def _check_vllm_cpu_reload() -> list[str]:
    from vllm import LLM
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    problems = _missing(
        _source(UnquantizedLinearMethod.process_weights_after_loading),
        "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)",
    )
    parameters = _parameters(GPUModelRunner.reload_weights)
    if parameters[:4] != ["self", "weights_iterator", "weights_path", "is_checkpoint_format"]:
        problems.append(f"GPUModelRunner.reload_weights takes {parameters}")
    problems += _missing(_source(GPUModelRunner.reload_weights), "initialize_layerwise_reload(model)")
    problems += _missing(_source(Worker.reload_weights), "self.model_runner.reload_weights(")
    if _parameters(LLM.collective_rpc)[:5] != ["self", "method", "timeout", "args", "kwargs"]:
        problems.append("LLM.collective_rpc no longer takes (method, timeout, args, kwargs)")
    return problems


def _check_vllm_cpu_tied_head() -> list[str]:
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    problems = _missing(_source(UnquantizedEmbeddingMethod.tie_weights), "layer.weight = embed_tokens.weight")
    problems += _missing(
        _source(UnquantizedEmbeddingMethod.process_weights_after_loading),
        "dispatch_cpu_unquantized_gemm(layer, remove_weight=False)",
    )
    return problems + _missing(_source(layer_utils.dispatch_cpu_unquantized_gemm), "layer.cpu_linear = ")


def _check_vllm_cpu_worker() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import torch_utils
    from vllm.v1.worker.cpu_worker import CPUWorker

    problems = _missing(_source(CPUWorker.init_device), "torch.set_num_threads = skip_set_num_threads")
    problems += _missing(_source(torch_utils.set_torch_threads_for_runtime), "torch.set_num_threads(1)")
    problems += _missing(
        _source(CpuPlatform.check_and_update_config),
        '"VLLM_CPU_KVCACHE_SPACE"',
        "cache_config.kv_cache_memory_bytes = kv_cache_space * GiB_bytes",
    )
    for method in (CPUWorker.sleep, CPUWorker.wake_up):
        problems += _missing(_source(method), "sleep mode is not supported on CPU, ignore it.")
    fields = EngineArgs.__dataclass_fields__
    problems += [
        f"EngineArgs has no {name}"
        for name in ("dtype", "enforce_eager", "kv_cache_memory_bytes")
        if name not in fields
    ]


FUSED_HEAD_FORWARD_PARAMETERS = [
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
]


def _check_fused_head() -> list[str]:
    problems = []
    for name in ("_ChunkedLogProbFunction", "_use_triton"):
        if not hasattr(trl_trainer_utils, name):
            problems.append(f"trl.trainer.utils no longer has {name}")
    found = _parameters(ChunkedLogProbFunction.forward)
    if found != FUSED_HEAD_FORWARD_PARAMETERS:
        problems.append(f"ChunkedLogProbFunction.forward takes {found}, expected {FUSED_HEAD_FORWARD_PARAMETERS}")
    problems += _missing(
        _source(ChunkedLogProbFunction.forward), "return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1"
    )
    return problems + _missing(
        _source(add_fused_lm_head),
        "compact = _use_triton(hidden_states.device)",
        "per_token = _ChunkedLogProbFunction.apply(",
        "hidden_states[mask] if compact else",
        "labels[mask] if compact else",
        "final_logit_softcapping,\n                logit_scale,\n                outputs,",
        "masked_scatter(mask, x)",
    )


def _check_decoder_loop() -> list[str]:
    from transformers import LlamaModel, Qwen3Model
    from transformers.cache_utils import DynamicCache, DynamicLayer
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    problems = _decoder_loop_problems(LlamaModel) + _decoder_loop_problems(Qwen3Model)
    if DECODER_CACHE_ARGUMENT not in _parameters(LlamaDecoderLayer.forward):
        problems.append(f"LlamaDecoderLayer.forward no longer takes {DECODER_CACHE_ARGUMENT!r}")
    problems += _missing(_source(LlamaAttention.forward), "cache.update(key_states, value_states, self.layer_idx")
    problems += _missing(_source(DynamicCache.update), "self.layers[layer_idx].update(")
    if not callable(getattr(DynamicLayer, "reorder_cache", None)):
        problems.append("DynamicLayer has no reorder_cache")
    return problems


SEAMS: tuple[Seam, ...] = (
    Seam(
        "per_token_logps_and_entropies",
        "_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size, "
        "compute_entropy, ...) returns (log_probs, entropies, aux_loss) for the loss, the old-log-prob pass and the "
        "reference pass.",
        "Forcing compute_entropy on the policy's passes gives p and H at no extra forward.",
        _check_per_token_logps,
    ),
    Seam(
        "generate_and_score_completions",
        "_generate_and_score_completions(inputs) returns the generation batch: completion_mask, tool_mask, "
        "advantages, num_items_in_batch (the loss-token count of the whole generation over all processes).",
        "Extra batch-first keys added to that dict survive TRL's shuffle and split into micro-batches.",
        _check_generate_and_score,
    ),
    Seam(
        "calculate_rewards",
        "_calculate_rewards(inputs, prompts, completions, completion_ids_list) calls every reward function on this "
        "process's completions and returns rewards_per_func [completions, functions], None as NaN; it refuses an "
        "output of the wrong length with a ValueError that starts \"The reward function '<name>'\".",
        "Wrapping it names the user's reward function that raised, and the step, and warns about infinite rewards.",
        _check_calculate_rewards,
    ),
    Seam(
        "generate_single_turn",
        "_generate_single_turn(prompt_ids, ...) samples once and returns (completion_ids, logprobs).",
        "Wrapping the first call of a generation lets the LM-head recorder see every sampling step.",
        _check_generate_single_turn,
    ),
    Seam(
        "on_optimizer_step_start",
        "_prepare_inputs buffers a generation's micro-batches in self._buffered_inputs and returns "
        "_buffered_inputs[self._step % steps_per_generation]; training_step then adds 1 to self._step.",
        "At a micro-batch whose index is a multiple of gradient_accumulation_steps, the next GA buffered dicts are "
        "the optimizer step's micro-batches, and TRL's loss reads them after they are edited.",
        _check_prepare_inputs,
    ),
    Seam(
        "wrap_train_sampler",
        "_get_train_sampler returns a RepeatSampler whose shuffle draws torch.randperm(num_samples, generator) "
        "from a generator seeded once with seed.",
        "Reseeding that generator and replaying earlier epochs gives any epoch's order (resume).",
        _check_train_sampler,
    ),
    Seam(
        "save_extra_state / load_extra_state",
        "Trainer._save_checkpoint saves the optimizer (_save_optimizer_and_scheduler) before trainer_state.json; "
        "_load_optimizer_and_scheduler(checkpoint) runs when training resumes.",
        "Files written after the optimizer are on disk before the checkpoint counts as complete.",
        _check_checkpoint_state,
    ),
    Seam(
        "log_metric",
        'self._metrics = {"train": defaultdict(list), "eval": ...}; log() averages each list, NaN skipped.',
        "Appending to self._metrics[mode][name] logs a metric with TRL's own at the next log.",
        _check_metrics,
    ),
    Seam(
        "is_vision_language_model",
        "__init__ sets self._is_vlm from the processing class.",
        "Vision-language batches take the TRL statistics backend and no generation-time recording.",
        _check_is_vlm,
    ),
    Seam(
        "card_name / card_tags / card_paper",
        "create_model_card names the trainer, tags and paper from the class attributes _name, _tag_names, _paper.",
        "Setting them on the subclass puts STAPO's name and paper on the card.",
        _check_model_card,
    ),
    Seam(
        "save_model_without_push",
        "Trainer.save_model(output_dir, _internal_call) pushes to the Hub unless _internal_call.",
        "stapo-trl train saves into a staging directory first and pushes once the files are in place.",
        _check_save_model,
    ),
    Seam(
        "set_model_name_or_path",
        "PretrainedConfig._name_or_path is what the model card names as the base model.",
        "Setting it names a GGUF's Hub source instead of its conversion in this machine's cache.",
        _check_name_or_path,
    ),
    Seam(
        "install_fused_head_op",
        "add_fused_lm_head's forward calls trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, "
        "targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs), which returns (log_probs, "
        "entropy, log_sum_sq_probs, mean_logits, is_top1); it passes only the labelled positions when "
        "trl.trainer.utils._use_triton(device) is true, and every position (labels clamped to 0) otherwise.",
        "Replacing both module names swaps the op under every fused head and lets the CPU score only labelled "
        "positions (stapo_trl.cpu_head).",
        _check_fused_head,
    ),
    Seam(
        "decoder_layers",
        "transformers' decoder-only backbones (LlamaModel, Qwen3Model, ...) run `for decoder_layer in "
        "self.layers[: self.config.num_hidden_layers]: hidden_states = decoder_layer(hidden_states, ..., cache=cache)`; "
        "each layer's attention stores its keys and values with cache.update(..., self.layer_idx), in "
        "cache.layers[layer_idx], whose reorder_cache(index) re-indexes them along the batch.",
        "Putting a module that returns recorded hidden states in place of the first frozen layer, and pass-through "
        "modules in place of the other frozen ones, skips them in the loss pass; at generate()'s first forward the "
        "same swap runs them once per distinct prompt and copies their cache entries to the repeats "
        "(stapo_trl.frozen_prefix).",
        _check_decoder_loop,
    ),
    Seam(
        "TRL helpers",
        "trl.models.utils.disable_gradient_checkpointing, trl.trainer.utils.get_config_model_id and "
        "maybe_gather_lm_head_ctx are TRL internals, not part of its top-level API.",
        "The statistics pass uses them as TRL's own passes do.",
        _check_helpers,
    ),
    Seam(
        "colocated vLLM on CPU: engine construction",
        "GRPOTrainer.__init__ builds VLLMGeneration (a name imported into trl.trainer.grpo_trainer) with mode, "
        "tensor_parallel_size, gpu_memory_utilization (default 0.3), enable_sleep_mode; in colocate mode "
        "_init_vllm calls the module's LLM(...) with external_launcher and no dtype, enforce_eager or KV cache size.",
        "colocated_vllm_on_cpu swaps that name for CPUColocatedVLLMGeneration while trainers are built, and adds "
        "dtype, enforce_eager and kv_cache_memory_bytes to the LLM(...) call.",
        _check_vllm_engine_construction,
    ),
    Seam(
        "colocated vLLM on CPU: weight sync",
        "_generate_single_turn calls vllm_generation.sync_weights() when global_step moved; in colocate mode "
        "sync_weights calls model_runner.model.load_weights once per (name, tensor) of _iter_named_params(), a "
        "generator that merges PEFT adapters and gathers shards, then resets the prefix cache.",
        "iter_vllm_weights yields the same tensors; the CPU sync sends them all to vLLM's reload_weights at once.",
        _check_vllm_weight_sync,
    ),
    Seam(
        "colocated vLLM on CPU: vLLM reload_weights",
        "vLLM's CPU backend packs each linear weight for its GEMM and replaces the parameter "
        "(dispatch_cpu_unquantized_gemm, remove_weight=True); reload_weights(weights_iterator, weights_path, "
        "is_checkpoint_format) restores the layers, loads and repacks them.",
        "LLM.collective_rpc('reload_weights', ...) runs in the training process (external launcher) and takes a "
        "generator of checkpoint-format tensors.",
        _check_vllm_cpu_reload,
        requires="vllm",
    ),
    Seam(
        "colocated vLLM on CPU: tied LM head",
        "A tied ParallelLMHead shares the embedding's weight (tie_weights) and packs its own CPU GEMM kernel from it "
        "(process_weights_after_loading, remove_weight=False), which reload_weights does not rebuild.",
        "Calling process_weights_after_loading again on every layer that shares a weight rebuilds layer.cpu_linear.",
        _check_vllm_cpu_tied_head,
        requires="vllm",
    ),
    Seam(
        "colocated vLLM on CPU: worker threads, KV cache, sleep",
        "CPUWorker.init_device replaces torch.set_num_threads with a no-op and vLLM sets torch to 1 thread; the CPU "
        "platform sizes the KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); CPUWorker.sleep and wake_up only warn.",
        "Restoring torch.set_num_threads and the thread count after the engine is built; EngineArgs takes dtype, "
        "enforce_eager and kv_cache_memory_bytes; sleep mode is refused.",
        _check_vllm_cpu_worker,
        requires="vllm",
    ),
)


def main() -> None:
    import trl

    print(f"stapo-trl seams, tested with TRL {TESTED_TRL}.x; installed: TRL {trl.__version__}")
    for seam in SEAMS:
        if not seam.can_check():
            print(f"skip {seam.name} ({seam.requires} is not installed)")
            continue
        problems = seam.check()
        print(f"{'ok  ' if not problems else 'FAIL'} {seam.name}")
        for problem in problems:
            print(f"       {problem}")


if __name__ == "__main__":
    main()
