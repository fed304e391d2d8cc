"""Evaluation: avg@k on the STAPO paper's six math benchmarks (`evaluate`), and greedy held-out accuracy for the
quickstart's before/after measurement (`greedy_accuracy`)."""

from .backends import (
    BACKENDS,
    DEFAULT_MAX_NEW_TOKENS,
    SAMPLING_PRESETS,
    BackendSpec,
    BackendUnavailableError,
    DataParallelBackend,
    Generation,
    GenerationBackend,
    GenerationRequest,
    SamplingParameters,
    SamplingPreset,
    TransformersBackend,
    VLLMBackend,
    build_backend,
)
from .config import ALL_BENCHMARKS, EvalConfig, EvalConfigError
from .greedy import GreedyAccuracy, greedy_accuracy
from .harness import EvalResult, evaluate, load_summary
from .models import ModelNotFoundError, ResolvedModel, resolve_model
from .records import ResumeMismatchError, SampleStore
from .results_table import chart_series, plot_results
from .scoring import (
    DEFAULT_GRADERS,
    BenchmarkScore,
    Grade,
    Grader,
    avg_at_k,
    avg_at_k_standard_error,
    pass_at_k,
    score_benchmark,
)

__all__ = [
    "ALL_BENCHMARKS",
    "BACKENDS",
    "DEFAULT_GRADERS",
    "DEFAULT_MAX_NEW_TOKENS",
    "SAMPLING_PRESETS",
    "BackendSpec",
    "BackendUnavailableError",
    "BenchmarkScore",
    "DataParallelBackend",
    "EvalConfig",
    "EvalConfigError",
    "EvalResult",
    "Generation",
    "GenerationBackend",
    "GenerationRequest",
    "Grade",
    "Grader",
    "GreedyAccuracy",
    "ModelNotFoundError",
    "ResolvedModel",
    "ResumeMismatchError",
    "SampleStore",
    "SamplingParameters",
    "SamplingPreset",
    "TransformersBackend",
    "VLLMBackend",
    "avg_at_k",
    "avg_at_k_standard_error",
    "build_backend",
    "chart_series",
    "evaluate",
    "greedy_accuracy",
    "load_summary",
    "pass_at_k",
    "plot_results",
    "resolve_model",
    "score_benchmark",
]
