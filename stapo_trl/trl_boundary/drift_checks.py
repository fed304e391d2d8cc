"""The drift checks of the TRL boundary: each place where stapo-trl relies on TRL 1.16's, transformers' or vLLM's
internals is one `Seam` in `SEAMS`, with what TRL 1.16 does there, what stapo-trl relies on, and a `check` that reads
the installed versions and lists what no longer fits.

The hooks the trainer overrides are in `stapo_trl.trl_boundary.hooks`, the module globals stapo-trl replaces in
`stapo_trl.trl_boundary.patches`. `tests/repository/test_trl_seams.py` runs every check; ``python -m
stapo_trl.trl_boundary`` prints them, which is where a port to a new TRL starts.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import trl
import trl.generation.vllm_generation as trl_vllm_generation
import trl.trainer.grpo_trainer as trl_grpo_trainer
import trl.trainer.utils as trl_trainer_utils
from transformers import LlamaModel, PretrainedConfig, Qwen3Model, Trainer
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import RepeatSampler, add_fused_lm_head

from .hooks import (
    DECODER_CACHE_ARGUMENT,
    TRL_REWARD_COUNT_MESSAGE,
    decoder_loop_problems,
    disable_gradient_checkpointing,
    get_config_model_id,
    maybe_gather_lm_head_ctx,
    missing,
)

# vLLM is optional: the checks that read it import it (`Seam.requires`).

TESTED_TRL = "1.16"


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


def _check_per_token_logps() -> list[str]:
    problems = []
    expected = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"]
    found = _parameters(GRPOTrainer._get_per_token_logps_and_entropies)
    if found[:7] != expected:
        problems.append(f"_get_per_token_logps_and_entropies takes {found}, expected {expected} first")
    return problems + missing(_source(GRPOTrainer._get_per_token_logps_and_entropies), "return logps, entropies")


def _check_generate_and_score() -> list[str]:
    problems = []
    if _parameters(GRPOTrainer._generate_and_score_completions) != ["self", "inputs"]:
        problems.append("_generate_and_score_completions no longer takes (self, inputs)")
    source = _source(GRPOTrainer._generate_and_score_completions)
    return problems + missing(source, '"num_items_in_batch"', '"advantages"', '"completion_mask"', '"tool_mask"')


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
    return problems + missing(source, "return rewards_per_func", TRL_REWARD_COUNT_MESSAGE, "torch.nan")


def _check_generate_single_turn() -> list[str]:
    return missing(_source(GRPOTrainer._generate_single_turn), "return completion_ids, logprobs")


def _check_prepare_inputs() -> list[str]:
    problems = missing(
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
    problems = missing(_source(GRPOTrainer._get_train_sampler), "RepeatSampler(")
    init, iterate = _source(RepeatSampler.__init__), _source(RepeatSampler.__iter__)
    problems += missing(init, "self.shuffle =", "self.seed =", "self.generator =", "self.num_samples =")
    return problems + missing(iterate, "torch.randperm(self.num_samples, generator=self.generator)")


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
    return missing(_source(GRPOTrainer.__init__), 'self._metrics = {"train": defaultdict(list)')


def _check_is_vlm() -> list[str]:
    return missing(_source(GRPOTrainer.__init__), "self._is_vlm = True", "self._is_vlm = False")


def _check_model_card() -> list[str]:
    names = ("_name", "_tag_names", "_paper")
    problems = [f"GRPOTrainer has no class attribute {name}" for name in names if not hasattr(GRPOTrainer, name)]
    return problems + missing(_source(GRPOTrainer.create_model_card), "self._name", "self._paper", "self._tag_names")


def _check_save_model() -> list[str]:
    problems = []
    if _parameters(Trainer.save_model) != ["self", "output_dir", "_internal_call"]:
        problems.append("Trainer.save_model no longer takes (self, output_dir, _internal_call)")
    return problems + missing(_source(Trainer.save_model), "if self.args.push_to_hub and not _internal_call:")


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


# --- colocated vLLM on vLLM's CPU backend (stapo_trl.cpu.colocated_vllm) ---------------------------------------


def _check_vllm_engine_construction() -> list[str]:
    generation = VLLMGeneration
    problems = []
    wanted = ["model", "mode", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode"]
    absent = [name for name in wanted if name not in _parameters(generation.__init__)]
    if absent:
        problems.append(f"VLLMGeneration.__init__ no longer takes {absent}")
    engine = _source(generation._init_vllm)
    problems += missing(engine, "self.llm = LLM(", 'distributed_executor_backend="external_launcher"')
    problems += [
        f"VLLMGeneration._init_vllm now passes {keyword}, which the CPU adapter adds itself"
        for keyword in ("dtype=", "enforce_eager=", "kv_cache_memory_bytes=")
        if keyword in engine
    ]
    problems += missing(inspect.getsource(trl_vllm_generation), "    from vllm import LLM, ")
    if getattr(trl_grpo_trainer, "VLLMGeneration", None) is not generation:
        problems.append("trl.trainer.grpo_trainer no longer imports VLLMGeneration by that name")
    problems += missing(_source(GRPOTrainer.__init__), "self.vllm_generation = VLLMGeneration(")
    default = GRPOConfig.__dataclass_fields__["vllm_gpu_memory_utilization"].default
    if default != 0.3:
        problems.append(f"GRPOConfig.vllm_gpu_memory_utilization defaults to {default}, not 0.3")
    return problems


def _check_vllm_weight_sync() -> list[str]:
    generation = VLLMGeneration
    problems = missing(
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
    problems += missing(
        single_turn, "if self.state.global_step != self._last_loaded_step:", "self.vllm_generation.sync_weights()"
    )
    return problems


def _check_vllm_cpu_reload() -> list[str]:
    from vllm import LLM
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    problems = missing(
        _source(UnquantizedLinearMethod.process_weights_after_loading),
        "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)",
    )
    parameters = _parameters(GPUModelRunner.reload_weights)
    if parameters[:4] != ["self", "weights_iterator", "weights_path", "is_checkpoint_format"]:
        problems.append(f"GPUModelRunner.reload_weights takes {parameters}")
    problems += missing(_source(GPUModelRunner.reload_weights), "initialize_layerwise_reload(model)")
    problems += missing(_source(Worker.reload_weights), "self.model_runner.reload_weights(")
    if _parameters(LLM.collective_rpc)[:5] != ["self", "method", "timeout", "args", "kwargs"]:
        problems.append("LLM.collective_rpc no longer takes (method, timeout, args, kwargs)")
    return problems


def _check_vllm_cpu_tied_head() -> list[str]:
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    problems = missing(_source(UnquantizedEmbeddingMethod.tie_weights), "layer.weight = embed_tokens.weight")
    problems += missing(
        _source(UnquantizedEmbeddingMethod.process_weights_after_loading),
        "dispatch_cpu_unquantized_gemm(layer, remove_weight=False)",
    )
    return problems + missing(_source(layer_utils.dispatch_cpu_unquantized_gemm), "layer.cpu_linear = ")


def _check_vllm_cpu_worker() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import torch_utils
    from vllm.v1.worker.cpu_worker import CPUWorker

    problems = missing(_source(CPUWorker.init_device), "torch.set_num_threads = skip_set_num_threads")
    problems += missing(_source(torch_utils.set_torch_threads_for_runtime), "torch.set_num_threads(1)")
    problems += missing(
        _source(CpuPlatform.check_and_update_config),
        '"VLLM_CPU_KVCACHE_SPACE"',
        "cache_config.kv_cache_memory_bytes = kv_cache_space * GiB_bytes",
    )
    for method in (CPUWorker.sleep, CPUWorker.wake_up):
        problems += missing(_source(method), "sleep mode is not supported on CPU, ignore it.")
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
    problems += missing(
        _source(ChunkedLogProbFunction.forward), "return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1"
    )
    return problems + missing(
        _source(add_fused_lm_head),
        "compact = _use_triton(hidden_states.device)",
        "per_token = _ChunkedLogProbFunction.apply(",
        "hidden_states[mask] if compact else",
        "labels[mask] if compact else",
        "final_logit_softcapping,\n                logit_scale,\n                outputs,",
        "masked_scatter(mask, x)",
    )


def _check_decoder_loop() -> list[str]:
    problems = decoder_loop_problems(LlamaModel) + decoder_loop_problems(Qwen3Model)
    if DECODER_CACHE_ARGUMENT not in _parameters(LlamaDecoderLayer.forward):
        problems.append(f"LlamaDecoderLayer.forward no longer takes {DECODER_CACHE_ARGUMENT!r}")
    problems += missing(_source(LlamaAttention.forward), "cache.update(key_states, value_states, self.layer_idx")
    problems += missing(_source(DynamicCache.update), "self.layers[layer_idx].update(")
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
        "positions (stapo_trl.cpu.lm_head).",
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
        "(stapo_trl.cpu.frozen_layer_replay).",
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
    print(f"stapo-trl seams, tested with TRL {TESTED_TRL}.x; installed: TRL {trl.__version__}")
    for seam in SEAMS:
        if not seam.can_check():
            print(f"skip {seam.name} ({seam.requires} is not installed)")
            continue
        problems = seam.check()
        print(f"{'ok  ' if not problems else 'FAIL'} {seam.name}")
        for problem in problems:
            print(f"       {problem}")
