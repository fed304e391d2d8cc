"""Math RL data for TRL: DAPO-Math-17K for training (`load_dapo_math`) and the six benchmarks of the STAPO paper for
evaluation (`load_benchmark`), from the Hub, a local file, or (`source="sample"`) the copies shipped with stapo-trl."""

from .benchmarks import BENCHMARKS, BenchmarkSpec, benchmark_answer, benchmark_spec, load_benchmark
from .dapo_math import DAPO_MATH_HUB_ID, OPEN_R1_HUB_ID, DedupReport, dedupe_by_problem, load_dapo_math
from .prompts import BOXED_INSTRUCTION, DAPO_PREFIX, DAPO_SUFFIX, PROMPT_STYLES, build_prompt, extract_problem
from .sources import ROW_FEATURES, SAMPLE, DatasetSchemaError, load_source, sample_path

__all__ = [
    "BENCHMARKS",
    "BOXED_INSTRUCTION",
    "DAPO_MATH_HUB_ID",
    "DAPO_PREFIX",
    "DAPO_SUFFIX",
    "OPEN_R1_HUB_ID",
    "PROMPT_STYLES",
    "ROW_FEATURES",
    "SAMPLE",
    "BenchmarkSpec",
    "DatasetSchemaError",
    "DedupReport",
    "benchmark_answer",
    "benchmark_spec",
    "build_prompt",
    "dedupe_by_problem",
    "extract_problem",
    "load_benchmark",
    "load_dapo_math",
    "load_source",
    "sample_path",
]
