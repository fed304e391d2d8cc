"""The TRL boundary's drift checks: each place where stapo-trl relies on TRL 1.16's, transformers' or vLLM's internals
is one `Seam` in `SEAMS`, checked against the installed versions (the verl plugin's, `stapo_trl.verl.drift`, too).
``python -m stapo_trl.trl_boundary`` prints them; `tests/repository/test_trl_seams.py` runs them."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import trl
import trl.trainer.grpo_trainer as trl_grpo_trainer
from transformers import PretrainedConfig
from trl import GRPOConfig
from trl.generation.vllm_generation import VLLMGeneration

from .helpers import DECODER_CACHE_ARGUMENT, DECODER_LOOP, TRL_REWARD_COUNT_MESSAGE, missing

TESTED_TRL = "1.16"

Check = Callable[[], list[str]]


def _reading(target: str, problems_of: Callable[[str, Any], list[str]]) -> Check:
    """A check that looks ``target`` (``"module:attribute.path"``) up when it runs and hands it to ``problems_of``."""

    def check() -> list[str]:
        module, _, path = target.partition(":")
        try:
            found = importlib.import_module(module)
            for name in filter(None, path.split(".")):
                found = getattr(found, name)
            return problems_of(path or module, found)
        except (ImportError, AttributeError, OSError, TypeError) as error:
            return [f"{target} cannot be read: {error!r}"]

    return check


def takes(target: str, parameters: str) -> Check:
    """``target``'s parameters are ``parameters`` (``"a, b"``; ``"a, ..."``: these first; ``"..., a"``: among them)."""
    expected = parameters.split(", ")

    def problems_of(label: str, function) -> list[str]:
        found = list(inspect.signature(function).parameters)
        if expected[0] == "...":
            absent = [name for name in expected[1:] if name not in found]
            return [f"{label} no longer takes {absent}"] if absent else []
        if expected[-1] == "...":
            first = expected[:-1]
            return [] if found[: len(first)] == first else [f"{label} takes {found}, expected {first} first"]
        return [] if found == expected else [f"{label} takes {found}, expected {expected}"]

    return _reading(target, problems_of)


def contains(target: str, *needles: str, in_order: bool = False) -> Check:
    """``target``'s source contains each of ``needles`` (in this order, with ``in_order``)."""

    def problems_of(label: str, found) -> list[str]:
        source = inspect.getsource(found)
        problems = [f"{label} {problem}" for problem in missing(source, *needles)]
        positions = [source.index(needle) for needle in needles if needle in source]
        if in_order and not problems and positions != sorted(positions):
            problems.append(f"{label} no longer runs {' before '.join(map(repr, needles))}")
        return problems

    return _reading(target, problems_of)


def has(target: str, *names: str) -> Check:
    """``target`` has the attributes ``names``."""
    return _reading(target, lambda label, found: [f"{label} has no {n}" for n in names if not hasattr(found, n)])


class Seam:
    """One touch point: what the library does there (``trl_does``), what stapo-trl relies on, and the checks of the
    installed versions; ``requires`` names a package the checks read besides TRL and transformers (``"vllm"``)."""

    def __init__(self, name: str, trl_does: str, we_rely_on: str, *checks: Check, requires: str | None = None):
        self.name, self.trl_does, self.we_rely_on, self.checks = name, trl_does, we_rely_on, checks
        self.requires = requires

    def can_check(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def check(self) -> list[str]:
        """What no longer fits in the installed versions; empty when everything does."""
        return [problem for check in self.checks for problem in check()]


def print_checks(seams: Iterable[Seam]) -> int:
    """Print each seam's verdict (``ok``, ``FAIL`` with its problems, or ``skip``); 1 when one fails, else 0."""
    failed = False
    for seam in seams:
        if not seam.can_check():
            print(f"skip {seam.name} ({seam.requires} is not installed)")
            continue
        problems = seam.check()
        failed |= bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {seam.name}")
        for problem in problems:
            print(f"       {problem}")
    return int(failed)


def _vllm_engine_construction() -> list[str]:
    engine = inspect.getsource(VLLMGeneration._init_vllm)
    problems = [
        f"VLLMGeneration._init_vllm now passes {keyword}, which the CPU adapter adds itself"
        for keyword in ("dtype=", "enforce_eager=", "kv_cache_memory_bytes=")
        if keyword in engine
    ]
    if getattr(trl_grpo_trainer, "VLLMGeneration", None) is not VLLMGeneration:
        problems.append("trl.trainer.grpo_trainer no longer imports VLLMGeneration by that name")
    default = GRPOConfig.__dataclass_fields__["vllm_gpu_memory_utilization"].default
    if default != 0.3:
        problems.append(f"GRPOConfig.vllm_gpu_memory_utilization defaults to {default}, not 0.3")
    return problems


GRPO = "trl:GRPOTrainer"
LOGPS = f"{GRPO}._get_per_token_logps_and_entropies"
GENERATION_BATCH = f"{GRPO}._generate_and_score_completions"
TRAINER = "transformers:Trainer"
SAMPLER = "trl.trainer.utils:RepeatSampler"
VLLM_GENERATION = "trl.generation.vllm_generation:VLLMGeneration"
LLAMA = "transformers.models.llama.modeling_llama"
CPU_WORKER = "vllm.v1.worker.cpu_worker:CPUWorker"
EMBEDDING_METHOD = "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod"
RELOAD_WEIGHTS = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights"
FUSED_HEAD_FORWARD = "trl.kernels:ChunkedLogProbFunction.forward"

SEAMS: tuple[Seam, ...] = (
    Seam(
        "per_token_logps_and_entropies",
        "_get_per_token_logps_and_entropies returns (log_probs, entropies, aux_loss) for every pass.",
        "Forcing compute_entropy on the policy's passes gives p and H at no extra forward.",
        takes(LOGPS, "self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, ..."),
        contains(LOGPS, "return logps, entropies"),
    ),
    Seam(
        "generate_and_score_completions",
        "_generate_and_score_completions returns the generation batch, with num_items_in_batch over all processes.",
        "Extra batch-first keys added to that dict survive TRL's shuffle and split into micro-batches.",
        takes(GENERATION_BATCH, "self, inputs"),
        contains(GENERATION_BATCH, '"num_items_in_batch"', '"advantages"', '"completion_mask"', '"tool_mask"'),
    ),
    Seam(
        "calculate_rewards",
        "_calculate_rewards returns rewards_per_func (None as NaN) and refuses an output of the wrong length.",
        "Wrapping it names the reward function that raised, and the step, and warns about infinite rewards.",
        takes(f"{GRPO}._calculate_rewards", "self, inputs, prompts, completions, completion_ids_list"),
        contains(f"{GRPO}._calculate_rewards", "return rewards_per_func", TRL_REWARD_COUNT_MESSAGE, "torch.nan"),
    ),
    Seam(
        "generate_single_turn",
        "_generate_single_turn samples once and returns (completion_ids, logprobs).",
        "Wrapping the first call of a generation lets the LM-head recorder see every sampling step.",
        contains(f"{GRPO}._generate_single_turn", "return completion_ids, logprobs"),
    ),
    Seam(
        "on_optimizer_step_start",
        "_prepare_inputs returns _buffered_inputs[self._step % steps_per_generation]; training_step then adds 1.",
        "From a multiple of gradient_accumulation_steps, the next GA buffered dicts are one optimizer step's.",
        contains(
            f"{GRPO}._prepare_inputs",
            "self._buffered_inputs = [",
            "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
        ),
        contains(
            f"{GRPO}.training_step",
            "super().training_step(model, inputs, num_items_in_batch)",
            "self._step += 1",
            in_order=True,
        ),
    ),
    Seam(
        "wrap_train_sampler",
        "RepeatSampler shuffles with torch.randperm from a generator seeded once with seed.",
        "Reseeding that generator and replaying earlier epochs gives any epoch's order (resume).",
        contains(f"{GRPO}._get_train_sampler", "RepeatSampler("),
        contains(f"{SAMPLER}.__init__", "self.shuffle =", "self.seed =", "self.generator =", "self.num_samples ="),
        contains(f"{SAMPLER}.__iter__", "torch.randperm(self.num_samples, generator=self.generator)"),
    ),
    Seam(
        "save_extra_state / load_extra_state",
        "Trainer._save_checkpoint saves the optimizer before trainer_state.json and loads it back on resume.",
        "Files written after the optimizer are on disk before the checkpoint counts as complete.",
        takes(f"{TRAINER}._save_optimizer_and_scheduler", "self, output_dir"),
        takes(f"{TRAINER}._load_optimizer_and_scheduler", "self, checkpoint"),
        contains(
            f"{TRAINER}._save_checkpoint",
            "self._save_optimizer_and_scheduler(output_dir)",
            "self.state.save_to_json(",
            in_order=True,
        ),
    ),
    Seam(
        "log_metric",
        "log() averages each list of self._metrics[mode], NaN skipped.",
        "Appending to self._metrics[mode][name] logs a metric with TRL's own at the next log.",
        contains(f"{GRPO}.__init__", 'self._metrics = {"train": defaultdict(list)'),
    ),
    Seam(
        "is_vision_language_model",
        "__init__ sets self._is_vlm from the processing class.",
        "Vision-language batches take the TRL statistics backend and no generation-time recording.",
        contains(f"{GRPO}.__init__", "self._is_vlm = True", "self._is_vlm = False"),
    ),
    Seam(
        "card_name / card_tags / card_paper",
        "create_model_card reads the trainer's name, tags and paper from _name, _tag_names and _paper.",
        "Setting them on the subclass puts STAPO's name and paper on the card.",
        has(GRPO, "_name", "_tag_names", "_paper"),
        contains(f"{GRPO}.create_model_card", "self._name", "self._paper", "self._tag_names"),
    ),
    Seam(
        "save_model_without_push",
        "Trainer.save_model(output_dir, _internal_call) pushes to the Hub unless _internal_call.",
        "stapo-trl train saves into a staging directory first and pushes once the files are in place.",
        takes(f"{TRAINER}.save_model", "self, output_dir, _internal_call"),
        contains(f"{TRAINER}.save_model", "if self.args.push_to_hub and not _internal_call:"),
    ),
    Seam(
        "set_model_name_or_path",
        "PretrainedConfig._name_or_path is what the model card names as the base model.",
        "Setting it names a GGUF's Hub source instead of its conversion in this machine's cache.",
        lambda: [] if "_name_or_path" in PretrainedConfig().to_dict() else ["PretrainedConfig has no _name_or_path"],
    ),
    Seam(
        "install_fused_head_op",
        "add_fused_lm_head's op scores only the labelled positions where _use_triton(device) is true.",
        "Replacing both names swaps the op under every fused head; the CPU scores only labelled positions.",
        has("trl.trainer.utils", "_ChunkedLogProbFunction", "_use_triton"),
        takes(
            FUSED_HEAD_FORWARD,
            "ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs",
        ),
        contains(FUSED_HEAD_FORWARD, "return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1"),
        contains(
            "trl.trainer.utils:add_fused_lm_head",
            "compact = _use_triton(hidden_states.device)",
            "per_token = _ChunkedLogProbFunction.apply(",
            "hidden_states[mask] if compact else",
            "labels[mask] if compact else",
            "final_logit_softcapping,\n                logit_scale,\n                outputs,",
            "masked_scatter(mask, x)",
        ),
    ),
    Seam(
        "decoder_layers",
        "Decoder-only backbones loop over self.layers, each attention caching in cache.layers[self.layer_idx].",
        "Swapping frozen layers' modules skips or shares their work (stapo_trl.cpu.frozen_layer_replay).",
        contains("transformers:LlamaModel.forward", *DECODER_LOOP),
        contains("transformers:Qwen3Model.forward", *DECODER_LOOP),
        takes(f"{LLAMA}:LlamaDecoderLayer.forward", f"..., {DECODER_CACHE_ARGUMENT}"),
        contains(f"{LLAMA}:LlamaAttention.forward", "cache.update(key_states, value_states, self.layer_idx"),
        contains("transformers.cache_utils:DynamicCache.update", "self.layers[layer_idx].update("),
        has("transformers.cache_utils:DynamicLayer", "reorder_cache"),
    ),
    Seam(
        "TRL helpers",
        "disable_gradient_checkpointing, get_config_model_id and maybe_gather_lm_head_ctx are TRL internals.",
        "The statistics pass uses them as TRL's own passes do.",
        takes("trl.models.utils:disable_gradient_checkpointing", "model, gradient_checkpointing_kwargs"),
        takes("trl.trainer.utils:get_config_model_id", "config"),
        takes("trl.trainer.utils:maybe_gather_lm_head_ctx", "params"),
    ),
    Seam(
        "colocated vLLM on CPU: engine construction",
        "GRPOTrainer builds VLLMGeneration, whose colocate engine gets no dtype, enforce_eager or KV cache size.",
        "colocated_vllm_on_cpu swaps that name for its adapter, which adds those three to the LLM(...) call.",
        takes(
            f"{VLLM_GENERATION}.__init__",
            "..., model, mode, tensor_parallel_size, gpu_memory_utilization, enable_sleep_mode",
        ),
        contains(
            f"{VLLM_GENERATION}._init_vllm", "self.llm = LLM(", 'distributed_executor_backend="external_launcher"'
        ),
        _vllm_engine_construction,
        contains("trl.generation.vllm_generation", "    from vllm import LLM, "),
        contains(f"{GRPO}.__init__", "self.vllm_generation = VLLMGeneration("),
    ),
    Seam(
        "colocated vLLM on CPU: weight sync",
        "sync_weights loads each tensor of _iter_named_params() into the engine, then resets the prefix cache.",
        "The CPU sync sends the same tensors to vLLM's reload_weights at once.",
        contains(
            f"{VLLM_GENERATION}.sync_weights",
            "for name, param in self._iter_named_params():",
            "model_runner.model.load_weights([(name, param)])",
            "self.llm.reset_prefix_cache()",
        ),
        takes(f"{VLLM_GENERATION}._iter_named_params", "self"),
        contains(f"{VLLM_GENERATION}._iter_named_params", "yield "),
        contains(
            f"{GRPO}._generate_single_turn",
            "if self.state.global_step != self._last_loaded_step:",
            "self.vllm_generation.sync_weights()",
        ),
    ),
    Seam(
        "colocated vLLM on CPU: vLLM reload_weights",
        "vLLM's CPU backend packs each linear weight for its GEMM; reload_weights loads and repacks them.",
        "LLM.collective_rpc('reload_weights', ...) runs in the training process with a generator of tensors.",
        contains(
            "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
            "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)",
        ),
        takes(RELOAD_WEIGHTS, "self, weights_iterator, weights_path, is_checkpoint_format, ..."),
        contains(RELOAD_WEIGHTS, "initialize_layerwise_reload(model)"),
        contains("vllm.v1.worker.gpu_worker:Worker.reload_weights", "self.model_runner.reload_weights("),
        takes("vllm:LLM.collective_rpc", "self, method, timeout, args, kwargs, ..."),
        requires="vllm",
    ),
    Seam(
        "colocated vLLM on CPU: tied LM head",
        "A tied LM head packs its own CPU GEMM kernel from the embedding's weight, which reload_weights leaves stale.",
        "Calling process_weights_after_loading again on every layer that shares a weight rebuilds layer.cpu_linear.",
        contains(f"{EMBEDDING_METHOD}.tie_weights", "layer.weight = embed_tokens.weight"),
        contains(
            f"{EMBEDDING_METHOD}.process_weights_after_loading",
            "dispatch_cpu_unquantized_gemm(layer, remove_weight=False)",
        ),
        contains("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "layer.cpu_linear = "),
        requires="vllm",
    ),
    Seam(
        "colocated vLLM on CPU: worker threads, KV cache, sleep",
        "vLLM's CPU worker sets torch to 1 thread, sizes the KV cache from VLLM_CPU_KVCACHE_SPACE and cannot sleep.",
        "The adapter restores torch's threads, passes the KV cache size itself and refuses sleep mode.",
        contains(f"{CPU_WORKER}.init_device", "torch.set_num_threads = skip_set_num_threads"),
        contains("vllm.utils.torch_utils:set_torch_threads_for_runtime", "torch.set_num_threads(1)"),
        contains(
            "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
            '"VLLM_CPU_KVCACHE_SPACE"',
            "cache_config.kv_cache_memory_bytes = kv_cache_space * GiB_bytes",
        ),
        contains(f"{CPU_WORKER}.sleep", "sleep mode is not supported on CPU, ignore it."),
        contains(f"{CPU_WORKER}.wake_up", "sleep mode is not supported on CPU, ignore it."),
        has("vllm.engine.arg_utils:EngineArgs", "dtype", "enforce_eager", "kv_cache_memory_bytes"),
        requires="vllm",
    ),
)


def main() -> int:
    print(f"stapo-trl seams, tested with TRL {TESTED_TRL}.x; installed: TRL {trl.__version__}")
    return print_checks(SEAMS)
