"""`stapo-trl train -h` and `stapo-trl eval -h`: the options in argparse argument groups, one line or one paragraph
each; `--help-all` prints the raw parser's listing. The evaluation package and TRL are imported only where used."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from ..core.token_rules import switched_rules
from ..methods import METHOD_NAMES

HELP_ALL_FLAG = "--help-all"

GROUPS: dict[str, dict[str, str]] = {
    "recipe and run": {
        "config": "a YAML recipe; flags on the command line override its keys",
        "method": f"{' | '.join(METHOD_NAMES)}: sets that method's defaults",
        "dry_run": "print the resolved plan (batch sizes, launch) and exit without loading anything",
        "output_dir": "where checkpoints, metrics.jsonl, the model card and run_summary.json go",
        "overwrite_output_dir": "start afresh in an output_dir that holds an earlier run (it is deleted)",
        "resume_from_checkpoint": "'last' (the newest complete checkpoint of output_dir) or a checkpoint-N dir",
        "max_steps": "optimizer steps to train",
        "seed": "random seed of data order, sampling and initialization",
    },
    "model": {
        "model_name_or_path": "a Hub id, a saved model directory, or a .gguf file",
        "dtype": "float32, bfloat16 or float16",
        "use_peft": "train a LoRA adapter instead of the full model",
        "lora_r": "LoRA rank",
        "lora_layers": "with use_peft: adapt only the last this many layers",
        "cpu_lm_head": "on the CPU, stapo-trl's fast path for TRL's fused LM head (default true)",
        "replay_frozen_layers": "on the CPU, reuse the frozen layers' states in the loss (default true)",
    },
    "data and rewards": {
        "dataset_name": "DAPO-Math-17K (Hub id or local file), 'sample', or 'arithmetic'",
        "prompt_style": "boxed (answer in \\boxed{}) or dapo (an 'Answer:' line)",
        "reward_funcs": "registered rewards (boxed, dapo, math_verify, ...) or dotted import paths",
        "reward_model_name_or_path": "a reward model (Hub id or path), added after reward_funcs, as trl grpo",
        "num_train_problems": "train on this many problems",
        "heldout_problems": "score this many held-out problems greedily before and after training",
    },
    "token rules": {
        "shadow_token_rules": "rules to compute and log without applying them, e.g. [s2t] with method grpo",
        "token_stats_source": "generation (the sampling policy) or loss (the policy being optimized)",
        "dump_silenced_tokens": "write a sample of silenced tokens in context (dump_tokens_per_step a step) to a file",
    },
    "batch and optimization": {
        "per_device_train_batch_size": "completions per device per micro-batch",
        "num_generations": "completions per prompt (the group)",
        "gradient_accumulation_steps": "micro-batches per optimizer step",
        "steps_per_generation": "micro-batches per generation (a multiple of gradient_accumulation_steps)",
        "learning_rate": "peak learning rate",
        "loss_type": "dapo (the paper's), grpo, bnpo, dr_grpo, ...",
    },
    "generation": {
        "temperature": "sampling temperature; p and H are taken under it",
        "max_completion_length": "tokens per completion",
        "use_vllm": "generate with vLLM (GPU)",
        "vllm_mode": "colocate or server",
    },
    "launch and logging": {
        "num_processes": "processes to launch with accelerate (one per GPU)",
        "accelerate_config": "an accelerate config file, or a shipped name such as zero3",
        "report_to": "none, wandb, tensorboard, ...",
        "push_to_hub": "upload the model and its card to the Hub",
    },
}
"""{group title: {option: one-line description}} of ``train -h``; a test checks that every option exists."""


def option_groups() -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """`GROUPS`, with each token rule's own group (``spec.presentation``) after "data and rewards"."""
    groups = [(title, tuple(options.items())) for title, options in GROUPS.items()]
    split = list(GROUPS).index("data and rewards") + 1
    rules = [(spec.presentation.help_title, spec.presentation.help_options) for spec in switched_rules()]
    return groups[:split] + [rule for rule in rules if rule[0]] + groups[split:]


def grouped_help(usage: str, description: str, groups, examples: list[str], help_position: int) -> str:
    """The help of a command; ``groups``: ``[(title, [(name, metavar or None, text)])]``."""
    formatter = functools.partial(argparse.RawDescriptionHelpFormatter, width=119, max_help_position=help_position)
    epilog = "\n".join(["examples:", *(f"  {example}" for example in examples)])
    parser = argparse.ArgumentParser(
        usage=usage, description=description, epilog=epilog, add_help=False, formatter_class=formatter
    )
    for title, options in groups:
        group = parser.add_argument_group(title)
        for name, metavar, text in options:
            settings = {"action": "store_true"} if metavar is None else {"metavar": metavar}
            group.add_argument(f"--{name}", help=text.replace("%", "%%"), **settings)
    return parser.format_help().rstrip()


def train_help(argv: list[str]) -> bool:
    """Print ``train -h`` (or ``--help-all``) if ``argv`` asks for it."""
    if HELP_ALL_FLAG in argv:
        from .recipe import make_train_parser

        make_train_parser().print_help()
    elif "-h" in argv or "--help" in argv:
        groups = [(title, [(name, None, text) for name, text in options]) for title, options in option_groups()]
        description = (
            "Train with a YAML recipe; any key of the recipe can also be given as --key value. The options people\n"
            "change most are below; `stapo-trl train --help-all` lists all of them, with TRL's and transformers' own."
            "\n`--traceback` prints the traceback of an error as well as its message."
        )
        examples = [
            "stapo-trl train --config recipes/quickstart/smollm2-135m-cpu.yaml",
            "stapo-trl train --config recipes/dapo_math_17k/qwen3-8b-base/stapo.yaml --dry_run",
            "stapo-trl train --config RECIPE.yaml --method grpo --seed 1 --output_dir outputs/grpo-seed1",
        ]
        usage = "stapo-trl train --config RECIPE.yaml [--option value ...]"
        print(grouped_help(usage, description, groups, examples, help_position=35))
    else:
        return False
    return True


EVAL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (title, tuple(names.split()))
    for title, names in {
        "model": "model adapter base_model label method model_size",
        "benchmarks and data": "benchmarks benchmark_source benchmark_sources benchmark_splits max_problems",
        "sampling": "presets temperature top_p samples_per_problem samples max_new_tokens seed",
        "prompt and grading": "prompt_style system_prompt chat_template graders",
        "generation backend": "backend batch_size tensor_parallel_size data_parallel_size gpu_memory_utilization "
        "max_model_len dtype device trust_remote_code",
        "output": "output_dir overwrite compare paper_comparison show_progress",
    }.items()
)
"""The groups of ``eval -h``, by `EvalConfig` field; a test checks that every field is in exactly one."""


def _metavar(item) -> str:
    kind = str(item.type)
    if "bool" in kind:
        return "true|false"
    if "list" in kind:
        return "VALUE [VALUE ...]"
    if "choices" in item.metadata:
        return "{" + ",".join(item.metadata["choices"]) + "}"
    return "INT" if "int" in kind else "FLOAT" if "float" in kind else "TEXT"


def eval_help(argv: list[str]) -> bool:
    """Print ``eval -h`` (each option once, with its help and default) or ``--help-all`` if ``argv`` asks for it."""
    from ..evaluation import EvalConfig

    if HELP_ALL_FLAG in argv:
        from trl import TrlParser

        TrlParser(dataclass_types=[EvalConfig], prog="stapo-trl eval").print_help()
        return True
    if "-h" not in argv and "--help" not in argv:
        return False
    fields = {item.name: item for item in dataclasses.fields(EvalConfig)}
    config_text = (
        "a YAML file of option: value pairs, checked as a train recipe is; flags on the command line override it"
    )
    groups = [("config", [("config", "FILE.yaml", config_text)])]
    for title, names in EVAL_GROUPS:
        options = []
        for name in names:
            item = fields[name]
            default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
            text = item.metadata.get("help", "")
            if default not in (None, [], "") and "default" not in text.lower():
                text += f" Default: {' '.join(default) if isinstance(default, list) else default}."
            options.append((name, _metavar(item), text))
        groups.append((title, options))
    description = (
        "avg@k on AIME24/25, AMC23, MATH500, Minerva and OlympiadBench under the paper's two sampling settings, with\n"
        "the paper's numbers beside ours. The defaults are the paper's protocol. `--traceback` prints the traceback of\n"
        "an error as well as its message; `stapo-trl eval --help-all` prints the raw parser's listing."
    )
    examples = [
        "stapo-trl eval --model outputs/quickstart-smollm2-135m-cpu --benchmark_source sample --max_new_tokens 160",
        "stapo-trl eval --model my-org/qwen3-8b-base-grpo --method grpo --data_parallel_size 8",
    ]
    usage = "stapo-trl eval --model MODEL [--option value ...]"
    print(grouped_help(usage, description, groups, examples, help_position=6))
    return True
