"""The arguments TRL 1.16 passes to vLLM's ``LLM(...)`` in colocate mode, derived from TRL's own source, and their
check against the installed vLLM's engine arguments, without loading a model.

TRL builds the engine in two calls: ``GRPOTrainer.__init__`` calls ``VLLMGeneration(..., tensor_parallel_size=
args.vllm_tensor_parallel_size, ...)``, and ``VLLMGeneration._init_vllm`` calls ``LLM(model=model.name_or_path,
tensor_parallel_size=self.tensor_parallel_size, ...)``. `trl_llm_arguments` reads both calls from the installed TRL
and evaluates their keyword expressions on a resolved config, so the result follows TRL's code rather than a copy of
it: a keyword TRL adds, renames or computes differently shows up here.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from types import SimpleNamespace
from typing import Any


def _calls(function, name: str) -> list[ast.Call]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def _evaluate(node: ast.expr, namespace: dict[str, Any]) -> Any:
    return eval(compile(ast.Expression(node), "<trl>", "eval"), {}, dict(namespace))  # noqa: S307


def vllm_generation_arguments(training) -> dict[str, Any]:
    """The keyword arguments of TRL's ``VLLMGeneration(...)`` call that depend on the config alone (``args.*``), plus
    the defaults of the others it does not pass."""
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    (call,) = _calls(GRPOTrainer.__init__, "VLLMGeneration")
    values = {}
    for keyword in call.keywords:
        names = {node.id for node in ast.walk(keyword.value) if isinstance(node, ast.Name)}
        if names <= {"args"}:
            values[keyword.arg] = _evaluate(keyword.value, {"args": training})
    for name, parameter in inspect.signature(VLLMGeneration.__init__).parameters.items():
        if name not in values and parameter.default is not inspect.Parameter.empty:
            values[name] = parameter.default
    return values


def _stored_attributes(generation_arguments: dict[str, Any]) -> dict[str, Any]:
    """``self.x = y`` of `VLLMGeneration.__init__` where ``y`` is one of its parameters."""
    from trl.generation.vllm_generation import VLLMGeneration

    tree = ast.parse(textwrap.dedent(inspect.getsource(VLLMGeneration.__init__)))
    attributes = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Attribute)
            and isinstance(node.targets[0].value, ast.Name)
            and node.targets[0].value.id == "self"
            and isinstance(node.value, ast.Name)
            and node.value.id in generation_arguments
        ):
            attributes[node.targets[0].attr] = generation_arguments[node.value.id]
    return attributes


def trl_llm_arguments(training, model_name: str, process_index: int = 0) -> dict[str, Any]:
    """The keyword arguments of the ``LLM(...)`` call TRL's colocate mode makes on process ``process_index`` for
    ``training`` (a `GRPOConfig` or `STAPOConfig`) and a model named ``model_name`` (no bitsandbytes quantization)."""
    from trl.generation.vllm_generation import VLLMGeneration

    attributes = _stored_attributes(vllm_generation_arguments(training))
    (call,) = _calls(VLLMGeneration._init_vllm, "LLM")
    namespace = {
        "self": SimpleNamespace(**attributes),
        "model": SimpleNamespace(name_or_path=model_name),
        "accelerator": SimpleNamespace(process_index=process_index),
        "quantization": None,
    }
    return {keyword.arg: _evaluate(keyword.value, namespace) for keyword in call.keywords}


def _command_line(arguments: dict[str, Any]) -> list[str]:
    argv = []
    for key, value in arguments.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{key.replace('_', '-')}")
        else:
            argv += [flag, str(value)]
    return argv


def engine_argument_problems(arguments: dict[str, Any]) -> list[str]:
    """What the installed vLLM refuses in ``LLM(**arguments)``, found without loading a model: unknown keys
    (`EngineArgs`), values its command line refuses (types and choices), values outside the ranges of its cache,
    parallel and scheduler configs, and a ``model_impl`` that is not one of its implementations."""
    import contextlib
    import io

    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig
    from vllm.config.model import ModelImpl
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    problems = []
    known = set(EngineArgs.__dataclass_fields__)
    unknown = sorted(set(arguments) - known)
    problems += [f"{key}: not an engine argument of this vLLM" for key in unknown]
    arguments = {key: value for key, value in arguments.items() if key in known}
    try:
        EngineArgs(**arguments)
    except Exception as error:  # the dataclass's own checks
        problems.append(f"EngineArgs: {type(error).__name__}: {error}")

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    message = io.StringIO()
    with contextlib.redirect_stderr(message):
        try:
            parser.parse_args(_command_line(arguments))
        except SystemExit:
            problems.append("command line: " + message.getvalue().strip().splitlines()[-1])

    checks = (
        (CacheConfig, {"gpu_memory_utilization", "kv_cache_memory_bytes"}, {}),
        (ParallelConfig, {"tensor_parallel_size", "distributed_executor_backend"}, {}),
        (SchedulerConfig, {"max_num_seqs", "max_num_batched_tokens"}, {"is_encoder_decoder": False}),
    )
    for config_class, keys, extra in checks:
        values = {key: arguments[key] for key in keys if arguments.get(key) is not None}
        if config_class is SchedulerConfig:
            values["max_model_len"] = arguments.get("max_model_len") or 8192
        try:
            config_class(**values, **extra)
        except Exception as error:
            problems.append(f"{config_class.__name__}: {str(error).splitlines()[0]}: {str(error).splitlines()[1:3]}")
    if "model_impl" in arguments:
        implementations = set(typing.get_args(ModelImpl))
        if arguments["model_impl"] not in implementations:
            problems.append(f"model_impl: {arguments['model_impl']!r} is not one of {sorted(implementations)}")
    return problems
