"""Generation backends for evaluation: `transformers` (any device, batched), `vllm` (GPUs, offline `LLM`), and data
parallelism over several backend processes. A backend takes prompts as token ids and returns one `Generation` per
requested sample; transformers, PEFT and vLLM are imported by the backend that runs them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import os
import queue
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, get_origin, get_type_hints

import torch

from ..core.errors import UsageError

BACKENDS = ("transformers", "vllm")


class BackendUnavailableError(UsageError, RuntimeError):
    """The requested backend cannot run here (for example, vLLM is not installed)."""


@dataclass(frozen=True)
class SamplingParameters:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int = 0


DEFAULT_MAX_NEW_TOKENS = 20480  # the paper evaluates with up to 20,480 new tokens per sample


@dataclass(frozen=True)
class SamplingPreset:
    """One of the paper's two evaluation sampling settings (STAPO, arXiv 2602.15620, Table 2): `training-aligned` is
    training's rollout distribution (the paper's first number), `justrl` JustRL's (its number in parentheses)."""

    name: str
    temperature: float
    top_p: float


SAMPLING_PRESETS = {
    preset.name: preset
    for preset in (SamplingPreset("training-aligned", 1.0, 1.0), SamplingPreset("justrl", 0.7, 0.9))
}


@dataclass(frozen=True)
class GenerationRequest:
    """Samples `sample_indices` of one problem. `key` identifies the problem across runs (it seeds the sampling)."""

    key: str
    prompt_token_ids: tuple[int, ...]
    sample_indices: tuple[int, ...]


@dataclass(frozen=True)
class Generation:
    text: str
    num_tokens: int
    finish_reason: str
    """"stop" when the model ended the sample itself, "length" when it hit `max_new_tokens`."""


class GenerationBackend(Protocol):
    name: str

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParameters) -> list[list[Generation]]:
        """One list per request, with one `Generation` per entry of its `sample_indices`, in order."""

    def close(self) -> None: ...


def request_seed(seed: int, key: str, sample_index: int) -> int:
    """A 31-bit seed for one sample, stable across runs and processes (Python's `hash` is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{key}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class BackendSpec:
    """Everything needed to build a backend in this or another process (it is pickled for data parallelism)."""

    kind: str
    weights: str
    tokenizer: str
    adapter: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    batch_size: int = 16
    device: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise BackendUnavailableError(
            "The vllm backend needs vLLM, which is not installed. Install it on a GPU machine with "
            "`pip install -e '.[vllm]'` in the stapo-trl clone (or `pip install vllm`), or evaluate with --backend transformers."
        )


def build_backend(spec: BackendSpec) -> GenerationBackend:
    if spec.kind == "transformers":
        return TransformersBackend(spec)
    if spec.kind == "vllm":
        require_vllm()
        return VLLMBackend(spec)
    raise ValueError(f"Unknown backend {spec.kind!r}; choose one of {BACKENDS}.")


def _torch_dtype(name: str):
    if name == "auto":
        return "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {name!r}; use auto, float32, bfloat16 or float16.")
    return dtype


class TransformersBackend:
    """Sampling with `model.generate` in left-padded batches of `batch_size` samples, on CPU or one GPU; a LoRA adapter
    is merged into the base weights. Each batch is seeded from its samples' keys and indices, so a resumed run makes
    the same samples as an uninterrupted one when the batches are the same."""

    name = "transformers"

    def __init__(self, spec: BackendSpec) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.spec = spec
        self.device = device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer, trust_remote_code=spec.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            spec.weights, dtype=_torch_dtype(spec.dtype), trust_remote_code=spec.trust_remote_code
        )
        if spec.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, spec.adapter).merge_and_unload()
        self.model = model.to(device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else next(iter(self.eos_token_ids), 0)

    def close(self) -> None:
        self.model = None

    def _decode(self, token_ids: list[int], max_new_tokens: int) -> Generation:
        """The sample up to and including its first end-of-sequence token."""
        stop = next((index for index, token in enumerate(token_ids) if token in self.eos_token_ids), None)
        kept = token_ids if stop is None else token_ids[: stop + 1]
        finish = "stop" if stop is not None or len(kept) < max_new_tokens else "length"
        return Generation(self.tokenizer.decode(kept, skip_special_tokens=True), len(kept), finish)

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParameters) -> list[list[Generation]]:
        jobs = [(r, position) for r, request in enumerate(requests) for position in range(len(request.sample_indices))]
        jobs.sort(key=lambda job: -len(requests[job[0]].prompt_token_ids))
        results: list[list[Generation | None]] = [[None] * len(request.sample_indices) for request in requests]
        sample = sampling.temperature != 0
        options = {"do_sample": sample, "max_new_tokens": sampling.max_new_tokens, "pad_token_id": self.pad_token_id}
        if sample:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        for start in range(0, len(jobs), self.spec.batch_size):
            batch = jobs[start : start + self.spec.batch_size]
            prompts = [requests[r].prompt_token_ids for r, _ in batch]
            width = max(len(prompt) for prompt in prompts)
            input_ids = torch.tensor(
                [[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=self.device
            )
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            seed_key = ",".join(f"{requests[r].key}#{requests[r].sample_indices[p]}" for r, p in batch)
            torch.manual_seed(request_seed(sampling.seed, seed_key, len(batch)))
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
            for row, (r, position) in enumerate(batch):
                results[r][position] = self._decode(output[row, width:].tolist(), sampling.max_new_tokens)
        return results  # type: ignore[return-value]


def vllm_lora_ranks() -> tuple[int, ...]:
    """The values vLLM's engine accepts as ``max_lora_rank``, smallest first: the `Literal` that annotates
    ``vllm.config.LoRAConfig.max_lora_rank`` in the installed vLLM."""
    from vllm.config import LoRAConfig

    annotation = get_type_hints(LoRAConfig).get("max_lora_rank")
    ranks = get_args(annotation) if get_origin(annotation) is Literal else ()
    if not ranks or not all(isinstance(rank, int) for rank in ranks):
        raise BackendUnavailableError(
            f"Cannot read the LoRA ranks this vLLM accepts: LoRAConfig.max_lora_rank is annotated {annotation!r}, not a "
            "Literal of whole numbers. Evaluate the adapter with --backend transformers."
        )
    return tuple(sorted(ranks))


def vllm_max_lora_rank(rank: int, accepted: Sequence[int]) -> int:
    """The ``max_lora_rank`` to start vLLM with for an adapter of rank ``rank``: the smallest of the ranks vLLM
    ``accepted`` that is at least ``rank`` (vLLM refuses any other value, and serves adapters of lower ranks)."""
    fitting = [value for value in sorted(accepted) if value >= rank]
    if not fitting:
        raise BackendUnavailableError(
            f"The adapter's rank is {rank}, and vLLM serves LoRA adapters up to rank {max(accepted)}. Evaluate it with "
            "--backend transformers, which merges the adapter into the base weights."
        )
    return fitting[0]


class VLLMBackend:
    """Offline vLLM: `LLM(...)`, one `SamplingParams(n=..., seed=...)` per problem, a `LoRARequest` for an adapter."""

    name = "vllm"

    def __init__(self, spec: BackendSpec) -> None:
        from vllm import LLM

        self.spec = spec
        same = ("dtype", "tensor_parallel_size", "gpu_memory_utilization", "trust_remote_code")
        options: dict[str, Any] = {"model": spec.weights, "tokenizer": spec.tokenizer}
        options.update({name: getattr(spec, name) for name in same})
        if spec.max_model_len is not None:
            options["max_model_len"] = spec.max_model_len
        self.lora_request = None
        if spec.adapter is not None:
            from vllm.lora.request import LoRARequest

            rank = json.loads((Path(spec.adapter) / "adapter_config.json").read_text()).get("r", 16)
            options.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(int(rank), vllm_lora_ranks()))
            self.lora_request = LoRARequest("adapter", 1, spec.adapter)
        self.llm = LLM(**options)

    def close(self) -> None:
        self.llm = None

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParameters) -> list[list[Generation]]:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": list(request.prompt_token_ids)} for request in requests]
        shared = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens}
        seeds = [request_seed(sampling.seed, r.key, r.sample_indices[0]) for r in requests]
        params = [
            SamplingParams(n=len(r.sample_indices), seed=s, **shared) for r, s in zip(requests, seeds, strict=True)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return [[self._generation(completion) for completion in output.outputs] for output in outputs]

    @staticmethod
    def _generation(completion) -> Generation:
        finish = "length" if completion.finish_reason == "length" else "stop"
        return Generation(completion.text, len(completion.token_ids), finish)


def _worker_main(spec: BackendSpec, visible_devices: str | None, inbox, outbox) -> None:
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    try:
        backend = build_backend(spec)
    except Exception as error:  # reported to the parent, which raises it
        outbox.put(("error", f"{type(error).__name__}: {error}"))
        return
    outbox.put(("ready", None))
    for requests, sampling in iter(inbox.get, None):
        try:
            outbox.put(("result", backend.generate(requests, sampling)))
        except Exception as error:
            outbox.put(("error", f"{type(error).__name__}: {error}"))
    backend.close()


class DataParallelBackend:
    """`data_parallel_size` copies of a backend, each in its own `spawn`ed process with its own devices (for vLLM,
    rank r sees GPUs r*tp .. r*tp+tp-1 through CUDA_VISIBLE_DEVICES). Each call splits the requests between the
    copies and gathers the results in order."""

    def __init__(self, spec: BackendSpec, data_parallel_size: int, devices_per_rank: int | None = None) -> None:
        if data_parallel_size < 2:
            raise ValueError("DataParallelBackend needs data_parallel_size >= 2; use build_backend for one copy.")
        self.name = f"{spec.kind} x{data_parallel_size}"
        context = multiprocessing.get_context("spawn")
        self._workers = []
        for rank in range(data_parallel_size):
            devices = ",".join(str(rank * devices_per_rank + d) for d in range(devices_per_rank or 0)) or None
            inbox, outbox = context.Queue(), context.Queue()
            # Not a daemon: vLLM starts its own engine processes, which daemonic processes may not do.
            process = context.Process(target=_worker_main, args=(spec, devices, inbox, outbox))
            process.start()
            self._workers.append((process, inbox, outbox))
        for rank in range(data_parallel_size):
            kind, payload = self._receive(rank)
            if kind == "error":
                self.close()
                raise RuntimeError(f"Data-parallel rank {rank} failed to start its backend: {payload}")

    def _receive(self, rank: int) -> tuple[str, Any]:
        """The next message from a rank, or an error if its process died without sending one."""
        process, _, outbox = self._workers[rank]
        while True:
            try:
                return outbox.get(timeout=5)
            except queue.Empty:
                if not process.is_alive():
                    return "error", f"the process exited with code {process.exitcode}"

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParameters) -> list[list[Generation]]:
        shards = [list(range(rank, len(requests), len(self._workers))) for rank in range(len(self._workers))]
        active = [(rank, shard) for rank, shard in enumerate(shards) if shard]
        for rank, shard in active:
            self._workers[rank][1].put(([requests[i] for i in shard], sampling))
        results: list[list[Generation] | None] = [None] * len(requests)
        for rank, shard in active:
            kind, payload = self._receive(rank)
            if kind == "error":
                raise RuntimeError(f"Data-parallel rank {rank} failed: {payload}")
            for index, generations in zip(shard, payload, strict=True):
                results[index] = generations
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for process, inbox, _ in self._workers:
            if process.is_alive():
                inbox.put(None)
        for process, _, _ in self._workers:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        self._workers = []
