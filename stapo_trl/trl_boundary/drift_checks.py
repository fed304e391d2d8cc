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
    """One touch point: what stapo-trl relies on in the library there (``relies_on``) and the checks of the installed
    versions; ``requires`` names a package the checks read besides TRL and transformers (``"vllm"``)."""

    def __init__(self, name: str, relies_on: str, *checks: Check, requires: str | None = None):
        self.name, self.relies_on, self.checks, self.requires = name, relies_on, checks, requires

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
        "Every pass returns (logps, entropies): forcing compute_entropy gives p and H at no extra forward.",
        takes(LOGPS, "self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, ..."),
        contains(LOGPS, "return logps, entropies"),
    ),
    Seam(
        "generate_and_score_completions",
        "The generation batch's extra batch-first keys survive TRL's shuffle and split into micro-batches.",
        takes(GENERATION_BATCH, "self, inputs"),
        contains(GENERATION_BATCH, '"num_items_in_batch"', '"advantages"', '"completion_mask"', '"tool_mask"'),
    ),
    Seam(
        "calculate_rewards",
        "_calculate_rewards refuses an output of the wrong length; wrapping it names the function and the step.",
        takes(f"{GRPO}._calculate_rewards", "self, inputs, prompts, completions, completion_ids_list"),
        contains(f"{GRPO}._calculate_rewards", "return rewards_per_func", TRL_REWARD_COUNT_MESSAGE, "torch.nan"),
    ),
    Seam(
        "generate_single_turn",
        "_generate_single_turn samples once: wrapping it lets the LM-head recorder see every sampling step.",
        contains(f"{GRPO}._generate_single_turn", "return completion_ids, logprobs"),
    ),
    Seam(
        "on_optimizer_step_start",
        "Micro-batch _step % steps_per_generation trains, then _step += 1: GA buffered dicts make one optimizer step.",
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
        "RepeatSampler shuffles with a generator seeded once: reseeding and replaying epochs gives any epoch's order.",
        contains(f"{GRPO}._get_train_sampler", "RepeatSampler("),
        contains(f"{SAMPLER}.__init__", "self.shuffle =", "self.seed =", "self.generator =", "self.num_samples ="),
        contains(f"{SAMPLER}.__iter__", "torch.randperm(self.num_samples, generator=self.generator)"),
    ),
    Seam(
        "save_extra_state / load_extra_state",
        "_save_checkpoint saves the optimizer, and files written with it, before trainer_state.json.",
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
        "log() averages each list of self._metrics[mode], NaN skipped: appending to one logs a metric with TRL's.",
        contains(f"{GRPO}.__init__", 'self._metrics = {"train": defaultdict(list)'),
    ),
    Seam(
        "is_vision_language_model",
        "__init__ sets self._is_vlm: vision-language batches take the TRL backend and no generation recording.",
        contains(f"{GRPO}.__init__", "self._is_vlm = True", "self._is_vlm = False"),
    ),
    Seam(
        "card_name / card_tags / card_paper",
        "create_model_card reads _name, _tag_names and _paper: set on the subclass, they put STAPO on the card.",
        has(GRPO, "_name", "_tag_names", "_paper"),
        contains(f"{GRPO}.create_model_card", "self._name", "self._paper", "self._tag_names"),
    ),
    Seam(
        "save_model_without_push",
        "save_model(output_dir, _internal_call=True) does not push: train pushes once the files are in place.",
        takes(f"{TRAINER}.save_model", "self, output_dir, _internal_call"),
        contains(f"{TRAINER}.save_model", "if self.args.push_to_hub and not _internal_call:"),
    ),
    Seam(
        "set_model_name_or_path",
        "The card names config._name_or_path as the base model: set, it names a GGUF's Hub source.",
        lambda: [] if "_name_or_path" in PretrainedConfig().to_dict() else ["PretrainedConfig has no _name_or_path"],
    ),
    Seam(
        "install_fused_head_op",
        "add_fused_lm_head scores labelled positions only where _use_triton: the CPU head replaces it and the op.",
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
        "Decoder layers run in a loop over self.layers, caching by layer_idx: the frozen-layer replay swaps them.",
        contains("transformers:LlamaModel.forward", *DECODER_LOOP),
        contains("transformers:Qwen3Model.forward", *DECODER_LOOP),
        takes(f"{LLAMA}:LlamaDecoderLayer.forward", f"..., {DECODER_CACHE_ARGUMENT}"),
        contains(f"{LLAMA}:LlamaAttention.forward", "cache.update(key_states, value_states, self.layer_idx"),
        contains("transformers.cache_utils:DynamicCache.update", "self.layers[layer_idx].update("),
        has("transformers.cache_utils:DynamicLayer", "reorder_cache"),
    ),
    Seam(
        "TRL helpers",
        "The statistics pass uses disable_gradient_checkpointing, get_config_model_id and maybe_gather_lm_head_ctx.",
        takes("trl.models.utils:disable_gradient_checkpointing", "model, gradient_checkpointing_kwargs"),
        takes("trl.trainer.utils:get_config_model_id", "config"),
        takes("trl.trainer.utils:maybe_gather_lm_head_ctx", "params"),
    ),
    Seam(
        "colocated vLLM on CPU: engine construction",
        "GRPOTrainer builds VLLMGeneration, whose LLM(...) the CPU adapter gives dtype, enforce_eager, KV cache size.",
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
        "sync_weights loads _iter_named_params() into the engine; the CPU sync sends them to reload_weights at once.",
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
        "collective_rpc('reload_weights', ...) loads and repacks each linear weight for the CPU GEMM in-process.",
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
        "A tied LM head packs its CPU kernel from the embedding's weight: process_weights_after_loading rebuilds it.",
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
        "The CPU worker sets 1 torch thread, sizes the KV cache from VLLM_CPU_KVCACHE_SPACE and cannot sleep.",
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
