"""Every DAPO recipe's vLLM settings against the engine arguments of the vLLM that TRL 1.16 supports (0.31), without
loading a model.

Each recipe is resolved as `stapo-trl train --dry_run` resolves it. The ``LLM(...)`` arguments TRL would pass on
process 0 are derived from TRL's own calls (`trl_engine_arguments.trl_llm_arguments`) and checked by the installed
vLLM: its `EngineArgs` (unknown keys), its command-line parser (types and choices), its cache, parallel and
scheduler configs (ranges). The sampling side is checked too: TRL's colocate sampling settings build a
``SamplingParams``. Runs where vLLM is installed (the vLLM environment of .ci/run); skips elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from trl_engine_arguments import engine_argument_problems, trl_llm_arguments

from stapo_trl.cli.recipe import parse_train_args

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed; these tests run in the vLLM environment of .ci/run (see the README)",
    ),
]

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DAPO_RECIPES = sorted((RECIPES / "dapo_math_17k").rglob("*.yaml"))
CPU_QUICKSTART = RECIPES / "quickstart" / "smollm2-135m-cpu-vllm.yaml"
VLLM_VERSION_TRL_SUPPORTS = "0.31.0"


def resolved(recipe: Path):
    return parse_train_args(["--config", str(recipe), "--dry_run"])


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A local directory standing in for a Hub model, so that no check of engine arguments looks the Hub up: with
    ``HF_HUB_OFFLINE=1`` vLLM's `EngineArgs` resolves a model id to its cached snapshot and fails without one, while a
    path that exists is taken as it is. It holds the model's architecture; the engine arguments checked here read
    nothing else from it."""
    root = tmp_path_factory.mktemp("models")

    def local(model_id: str) -> str:
        directory = root / model_id.replace("/", "--")
        directory.mkdir(exist_ok=True)
        architecture = "LlamaForCausalLM" if "SmolLM2" in model_id else "Qwen3ForCausalLM"
        model_type = "llama" if "SmolLM2" in model_id else "qwen3"
        (directory / "config.json").write_text(
            json.dumps({"architectures": [architecture], "model_type": model_type, "_name_or_path": model_id})
        )
        return str(directory)

    return local


def test_the_installed_vllm_is_the_newest_trl_supports():
    import vllm

    assert vllm.__version__ == VLLM_VERSION_TRL_SUPPORTS


def test_there_are_dapo_recipes_and_all_of_them_generate_with_colocated_vllm():
    assert len(DAPO_RECIPES) == 18
    for recipe in DAPO_RECIPES:
        training = resolved(recipe).training
        assert training.use_vllm and training.vllm_mode == "colocate", recipe


@pytest.mark.parametrize("recipe", DAPO_RECIPES, ids=lambda path: str(path.relative_to(RECIPES / "dapo_math_17k")))
def test_each_dapo_recipe_builds_valid_vllm_engine_arguments(recipe, stand_in):
    request = resolved(recipe)
    training = request.training
    arguments = trl_llm_arguments(training, stand_in(request.model.model_name_or_path))
    # The recipe's own vLLM settings reach the engine as TRL maps them.
    assert arguments["tensor_parallel_size"] == training.vllm_tensor_parallel_size
    assert arguments["gpu_memory_utilization"] == training.vllm_gpu_memory_utilization
    assert arguments["max_model_len"] == training.vllm_max_model_length
    assert arguments["max_num_seqs"] == (
        training.per_device_train_batch_size * training.vllm_tensor_parallel_size * training.steps_per_generation
    )
    assert arguments["distributed_executor_backend"] == "external_launcher"
    assert engine_argument_problems(arguments) == []
    # The context must hold the longest prompt the recipe keeps plus the longest completion.
    assert training.vllm_max_model_length >= request.script.max_prompt_tokens + training.max_completion_length


@pytest.mark.parametrize("recipe", DAPO_RECIPES[:1], ids=lambda path: path.stem)
def test_each_dapo_recipe_builds_valid_sampling_parameters(recipe):
    from trl_engine_arguments import vllm_generation_arguments
    from vllm import SamplingParams

    values = vllm_generation_arguments(resolved(recipe).training)
    SamplingParams(
        n=1,
        repetition_penalty=values["repetition_penalty"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"],
        min_p=values["min_p"],
        max_tokens=values["max_completion_length"],
        logprobs=values["logprobs"],
        **(values["generation_kwargs"] or {}),
    )


def test_the_cpu_quickstart_builds_valid_engine_arguments_with_the_cpu_adapters_additions(stand_in):
    request = resolved(CPU_QUICKSTART)
    arguments = trl_llm_arguments(request.training, stand_in("HuggingFaceTB/SmolLM2-135M-Instruct"))
    arguments.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**30)
    assert engine_argument_problems(arguments) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        ({"gpu_memory_utilisation": 0.35}, "gpu_memory_utilisation: not an engine argument"),
        ({"gpu_memory_utilization": 1.5}, "CacheConfig"),
        ({"tensor_parallel_size": 0}, "ParallelConfig"),
        ({"max_num_seqs": 0}, "SchedulerConfig"),
        ({"logprobs_mode": "processed_probs"}, "command line"),
        ({"model_impl": "vllm_v2"}, "model_impl"),
        ({"max_model_len": "long"}, "command line"),
    ],
)
def test_an_unknown_or_invalid_engine_argument_is_reported(change, reported, stand_in):
    arguments = trl_llm_arguments(resolved(DAPO_RECIPES[0]).training, stand_in("Qwen/Qwen3-1.7B-Base"))
    assert engine_argument_problems(arguments) == []
    problems = engine_argument_problems({**arguments, **change})
    assert any(reported in problem for problem in problems), problems
