"""The `stapo-trl` command line: `stapo-trl train --config RECIPE.yaml [--key value ...]` and
`stapo-trl eval --model CHECKPOINT [--key value ...]` and `stapo-trl report RUN_DIR [RUN_DIR ...]`."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "train": "Train with a YAML recipe (STAPO, GRPO, 20-Entropy, JustRL or STARE); --dry_run prints the plan.",
    "eval": "avg@k on AIME24/25, AMC23, MATH500, Minerva and OlympiadBench, beside the paper's numbers.",
    "report": "Plots and a summary of training runs: entropy, reward, the mask, p-H density, silenced tokens.",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stapo-trl",
        description="STAPO (Spurious-Token-Aware Policy Optimization) for Hugging Face TRL.",
        epilog="Run `stapo-trl train -h`, `stapo-trl eval -h` or `stapo-trl report -h` for every option.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        subcommands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command = argv[0]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose one of: {', '.join(COMMANDS)}")
    if command == "train":
        from .train import train_command

        return train_command(argv[1:])
    if command == "eval":
        from .evaluate import eval_command

        return eval_command(argv[1:])
    if command == "report":
        from .report import report_command

        return report_command(argv[1:])
    raise AssertionError(command)
