"""`EvalConfig`: what `stapo-trl eval` and `stapo_trl.evaluation.evaluate` take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.errors import UsageError
from ..data.benchmarks import BENCHMARKS, benchmark_spec
from ..data.prompts import PROMPT_STYLES, check_prompt_style
from ..methods import method_preset
from ..rewards import available_rewards
from .backends import BACKENDS, DEFAULT_MAX_NEW_TOKENS, SAMPLING_PRESETS
from .scoring import DEFAULT_GRADERS

ALL_BENCHMARKS = list(BENCHMARKS)


class EvalConfigError(UsageError, ValueError):
    """An evaluation setting is invalid; the message says what to change."""


def _lookup(function, name: str, prefix: str = ""):
    """`function(name)`, its ValueError raised as an `EvalConfigError` (after `prefix`)."""
    try:
        return function(name)
    except ValueError as error:
        raise EvalConfigError(f"{prefix}{error}") from None


def _pairs(entries: list[str], what: str) -> dict[str, str]:
    """`["aime24=8", ...]` as `{"aime24": "8"}`, with benchmark aliases resolved."""
    pairs = {}
    for entry in entries:
        name, sep, value = str(entry).partition("=")
        if not sep or not name.strip() or not value.strip():
            raise EvalConfigError(f"{what} entries are written NAME=VALUE (for example aime24=8), got {entry!r}.")
        pairs[_lookup(benchmark_spec, name, f"{what}: ").name] = value.strip()
    return pairs


def _option(default: Any, help: str, **metadata: Any) -> Any:
    """A field with its command-line help; a list default is copied for each instance."""
    metadata = {"help": help, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EvalConfig:
    """Settings of an avg@k evaluation on the STAPO paper's math benchmarks. The defaults are the paper's protocol
    (arXiv 2602.15620, Table 2): all six benchmarks, both sampling settings, 32 samples per problem on AIME24, AIME25
    and AMC23 and 4 on the others, up to 20,480 new tokens."""

    model: str | None = _option(
        None,
        "The model: a Hub id, a checkpoint directory, a LoRA adapter directory (its base is the GGUF file it was "
        "trained on when its run_summary.json records one, else the base in adapter_config.json), or a .gguf file.",
    )
    adapter: str | None = _option(None, "A LoRA adapter directory to apply to `model`.")
    base_model: str | None = _option(None, "The base of an adapter, when adapter_config.json names no usable one.")
    label: str | None = _option(None, "The model's name in tables; defaults to the checkpoint directory's name.")
    method: str | None = _option(
        None,
        "Training method for the paper's row (stapo, grpo, 20-entropy, justrl, stare); default: run_summary.json's.",
    )
    model_size: str | None = _option(None, "Model size for the paper's row (1.7B, 8B, 14B); default: from its name.")
    benchmarks: list[str] = _option(ALL_BENCHMARKS, f"The benchmarks, from {ALL_BENCHMARKS}. Default: all six.")
    benchmark_source: str | None = _option(
        None, "Where every benchmark loads from: `sample` for the problems shipped with stapo-trl. Default: the Hub."
    )
    benchmark_sources: list[str] = _option([], "Per-benchmark sources as NAME=SOURCE (Hub id, local path, `sample`).")
    benchmark_splits: list[str] = _option([], "Per-benchmark splits as NAME=SPLIT, for sources with other splits.")
    max_problems: int | None = _option(None, "Evaluate the first N problems of each benchmark (marked in tables).")
    presets: list[str] = _option(
        list(SAMPLING_PRESETS),
        "Sampling settings: training-aligned (T=1.0, top-p=1.0) and/or justrl (T=0.7, top-p=0.9). Default: both.",
    )
    temperature: float | None = _option(None, "Override the preset's temperature (then only one preset may be given).")
    top_p: float | None = _option(None, "Override the preset's top-p (then only one preset may be given).")
    samples_per_problem: int | None = _option(None, "Samples per problem for every benchmark (the k of avg@k).")
    samples: list[str] = _option([], "Per-benchmark samples per problem as NAME=K, for example aime24=8.")
    max_new_tokens: int = _option(DEFAULT_MAX_NEW_TOKENS, "Maximum new tokens per sample (the paper: 20480).")
    prompt_style: str = _option("boxed", "The instruction style, as in training.", choices=list(PROMPT_STYLES))
    system_prompt: str | None = _option(None, "A system message put before every prompt.")
    chat_template: bool = _option(True, "Format prompts with the tokenizer's chat template (else plain message text).")
    graders: list[str] | None = _option(
        None,
        "Rewards that grade a sample; it is correct when any accepts it. Default: boxed and math_verify (dapo and "
        "math_verify for prompt_style dapo).",
    )
    backend: str = _option(
        "auto",
        "vllm (GPUs), transformers (any device), or auto (vllm if installed and a GPU is visible, else transformers).",
        choices=["auto", *BACKENDS],
    )
    batch_size: int | None = _option(
        None, "Samples per generation call (transformers: 16; vllm: 4096, generated and saved at a time)."
    )
    tensor_parallel_size: int = _option(1, "vLLM tensor-parallel size (GPUs per copy).")
    data_parallel_size: int = _option(1, "Model copies, each in its own process on its own GPUs; problems are split.")
    gpu_memory_utilization: float = _option(0.9, "vLLM's share of each GPU's memory.")
    max_model_len: int | None = _option(None, "vLLM's context length; default: the model's.")
    dtype: str = _option("auto", "Weights dtype: auto, bfloat16, float16 or float32 (CPU: float32).")
    device: str | None = _option(None, "transformers backend device; default: cuda when available, else cpu.")
    trust_remote_code: bool = _option(False, "Allow custom model code from the Hub.")
    seed: int = _option(0, "Sampling seed; each sample's seed derives from it.")
    output_dir: str | None = _option(
        None, "Where samples, summary.json and results.md go (default evals/<label>); the same directory resumes."
    )
    overwrite: bool = _option(False, "Discard samples already in output_dir and start over.")
    compare: list[str] = _option([], "Earlier eval output dirs (or summary.json files) to add as rows of the table.")
    paper_comparison: bool = _option(True, "Print the paper's row under ours when one exists for the size and method.")
    show_progress: bool = _option(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        if not self.model:
            raise EvalConfigError("No model: pass --model (a Hub id, a checkpoint or adapter directory, or a .gguf).")
        self.benchmarks = [self.benchmarks] if isinstance(self.benchmarks, str) else self.benchmarks
        if not self.benchmarks:
            raise EvalConfigError(f"No benchmarks: pass --benchmarks with some of {ALL_BENCHMARKS}.")
        self.benchmarks = list(dict.fromkeys(_lookup(benchmark_spec, name).name for name in self.benchmarks))
        self.presets = [self.presets] if isinstance(self.presets, str) else self.presets
        if not self.presets:
            raise EvalConfigError(f"No sampling preset: pass --presets with some of {list(SAMPLING_PRESETS)}.")
        if unknown := [preset for preset in self.presets if preset not in SAMPLING_PRESETS]:
            raise EvalConfigError(f"Unknown preset {unknown[0]!r}; choose from {list(SAMPLING_PRESETS)}.")
        self.presets = list(dict.fromkeys(self.presets))
        overridden = [name for name in ("temperature", "top_p") if getattr(self, name) is not None]
        if overridden and len(self.presets) > 1:
            raise EvalConfigError(
                f"{' and '.join(overridden)} override one preset's value; pass a single --presets with them."
            )
        if self.temperature is not None and self.temperature < 0:
            raise EvalConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise EvalConfigError(f"top_p must be in (0, 1], got {self.top_p}.")
        counts = ("max_new_tokens", "samples_per_problem", "max_problems", "batch_size", "max_model_len")
        for name in (*counts, "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EvalConfigError(f"{name} must be at least 1, got {value}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EvalConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        self.source_overrides = _pairs(self.benchmark_sources, "benchmark_sources")
        self.split_overrides = _pairs(self.benchmark_splits, "benchmark_splits")
        self.sample_overrides = _pairs(self.samples, "samples")
        for name, value in self.sample_overrides.items():
            if not value.isdigit() or int(value) < 1:
                raise EvalConfigError(f"samples: {name}={value} is not a positive whole number.")
            self.sample_overrides[name] = int(value)
        _lookup(check_prompt_style, self.prompt_style)
        if self.graders is None:
            self.graders = list(DEFAULT_GRADERS[self.prompt_style])
        if not self.graders:
            raise EvalConfigError("graders is empty; name at least one, for example boxed.")
        known = available_rewards()
        if unknown := [name for name in self.graders if name not in known and "." not in name and ":" not in name]:
            raise EvalConfigError(f"Unknown grader {unknown[0]!r}; choose from {sorted(known)} or give a dotted path.")
        if self.backend not in ("auto", *BACKENDS):
            raise EvalConfigError(f"Unknown backend {self.backend!r}; choose auto, {', '.join(BACKENDS)}.")
        if self.backend == "transformers" and self.tensor_parallel_size > 1:
            raise EvalConfigError("tensor_parallel_size > 1 needs --backend vllm; transformers runs on one device.")
        if self.method is not None:
            self.method = _lookup(method_preset, self.method).name

    def samples_for(self, benchmark: str) -> int:
        """The k of avg@k for a benchmark: its override, else samples_per_problem, else the paper's (32 or 4)."""
        default = self.samples_per_problem or BENCHMARKS[benchmark].samples_per_problem
        return self.sample_overrides.get(benchmark, default)

    def source_for(self, benchmark: str) -> str | None:
        return self.source_overrides.get(benchmark, self.benchmark_source)

    def sampling_settings(self) -> list[tuple[str, float, float]]:
        """(name, temperature, top_p) per setting. A preset with an overridden value is named `custom`."""
        settings = []
        for name in self.presets:
            preset = SAMPLING_PRESETS[name]
            temperature = preset.temperature if self.temperature is None else self.temperature
            top_p = preset.top_p if self.top_p is None else self.top_p
            changed = (temperature, top_p) != (preset.temperature, preset.top_p)
            settings.append(("custom" if changed else name, temperature, top_p))
        return settings
