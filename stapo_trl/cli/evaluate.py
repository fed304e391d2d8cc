"""`stapo-trl eval`: avg@k of a model on the paper's benchmarks, with the paper's numbers beside ours."""

from __future__ import annotations

import sys
from typing import Any

from .. import evaluation
from ..core.errors import UsageError
from ..evaluation import EvalConfig, EvalConfigError
from .config_file import ConfigFileKind, apply_config, parser_actions, read_config_flag, suggest
from .help import eval_help

PROG = "stapo-trl eval"
EVAL_CONFIG = ConfigFileKind(PROG, "config file", "whose keys are the options of `stapo-trl eval -h`", EvalConfigError)


def parse_eval_args(argv: list[str]) -> EvalConfig:
    """An `EvalConfig` from the command line; a ``--config FILE.yaml``'s keys are checked and set the defaults."""
    from trl import TrlParser

    path, values, cli_args = read_config_flag(argv, EVAL_CONFIG)
    parser = TrlParser(dataclass_types=[EvalConfig], prog=PROG)
    parser.set_defaults_with_config(**apply_config(parser, values, str(path), EVAL_CONFIG))
    config, remaining = parser.parse_args_into_dataclasses(args=cli_args, return_remaining_strings=True)
    if remaining:
        unknown = next((token for token in remaining if token.startswith("--")), remaining[0])
        raise EvalConfigError(
            f"Unknown arguments: {' '.join(remaining)}."
            + suggest(unknown.lstrip("-").split("=", 1)[0], parser_actions(parser))
            + f" Run `{PROG} -h` for every option."
        )
    return config


def describe_setting(label: str, setting: dict[str, Any], graders: list[str]) -> list[str]:
    """One line per benchmark: avg@k, the samples, each grader's count, answers found and truncations."""
    lines = [f"{label} [{setting['name']}: {setting['label']}]"]
    for name, score in setting["benchmarks"].items():
        per_grader = ", ".join(f"{grader} {score['grader_correct'][grader]}" for grader in graders)
        answered = ", ".join(f"{grader} {score['grader_answered'][grader]}" for grader in graders)
        status = "" if score["complete"] else f"  (unfinished: {score['samples']}/{score['expected_samples']})"
        lines.append(
            f"  {name:<14} avg@{score['samples_per_problem']:<3} {score['avg_at_k']:6.2f} ± {score['standard_error']:.2f}"
            f"  correct {score['correct']}/{score['samples']} ({per_grader})"
            f"  answer found ({answered})  truncated {score['truncated']}"
            f"  mean length {score['mean_completion_tokens']:.0f} tokens{status}"
        )
    return lines


def eval_command(argv: list[str]) -> int:
    if eval_help(argv):
        return 0
    try:
        config = parse_eval_args(argv)
        result = evaluation.evaluate(config)
    except FileNotFoundError as error:
        if isinstance(error, UsageError):
            raise
        raise EvalConfigError(str(error)) from error
    except KeyboardInterrupt:
        print(
            f"\n{PROG}: interrupted. Every finished batch of samples is saved in the output directory; run the same "
            "command again to resume.",
            file=sys.stderr,
        )
        return 130
    print()
    for setting in result.summary["settings"]:
        print("\n".join(describe_setting(result.summary["model"]["label"], setting, result.summary["graders"])))
    print()
    print(result.table)
    for what, path in result.files.items():
        print(f"{what:<28} {path}")
    return 0
