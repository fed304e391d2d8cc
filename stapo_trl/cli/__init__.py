"""The `stapo-trl` command line: `stapo-trl train --config RECIPE.yaml [--key value ...]`,
`stapo-trl eval --model CHECKPOINT [--key value ...]`, `stapo-trl report RUN_DIR [RUN_DIR ...]` and
`stapo-trl counterfactual RUN_DIR`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..core.errors import UsageError

COMMANDS = {
    "train": "Train with a YAML recipe (STAPO, GRPO, 20-Entropy, JustRL or STARE); --dry_run prints the plan.",
    "eval": "avg@k on AIME24/25, AMC23, MATH500, Minerva and OlympiadBench, beside the paper's numbers.",
    "report": "Plots and a summary of training runs: entropy, reward, the mask, p-H density, silenced tokens.",
    "counterfactual": "Apply a run's saved updates again with other tokens silenced, and read what each did.",
}
EVAL = "stapo-trl eval"
TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENVIRONMENT = "STAPO_TRL_TRACEBACK"
"""Print an error's traceback as well as its message (`--debug` is a transformers training argument)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stapo-trl",
        description="STAPO (Spurious-Token-Aware Policy Optimization) for Hugging Face TRL.",
        epilog="Run `stapo-trl COMMAND -h` (train, eval, report, counterfactual) for every option. `--traceback` "
        "(or STAPO_TRL_TRACEBACK=1) prints the traceback of an error as well as its message.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        subcommands.add_parser(name, help=help_text, add_help=False)
    return parser


def report_command(argv: list[str]) -> int:
    """`stapo-trl report RUN_DIR [RUN_DIR ...]`: plots and a Markdown summary of training runs, on shared axes."""
    parser = argparse.ArgumentParser(
        prog="stapo-trl report",
        description="Plot and summarize training runs on shared axes (reward, entropy, the silenced fraction, tau_h, "
        "gradient norm, length, clipping, the held-out accuracy problem by problem, and from the silenced-token dump "
        "where silenced tokens sit over p and H), from each run's trainer_state.json (else metrics.jsonl).",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="training output directories")
    parser.add_argument(
        "--output_dir", help="where the PNGs and report.md go (default RUN_DIR/report; report-<a>-vs-<b> for several)"
    )
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: directory names)")
    parser.add_argument("--html", action="store_true", help="also write report.html with the figures inlined")
    top_help = "tokens in the top-silenced-tokens chart (bars, or a table in context when counts are equal)"
    parser.add_argument("--top_tokens", type=int, default=15, help=top_help)
    args = parser.parse_args(argv)
    from ..diagnostics.report import ReportError, console_lines, write_report

    if args.top_tokens < 1:
        raise ReportError(f"--top_tokens is {args.top_tokens}; it must be at least 1.")
    output_dir = Path(args.output_dir) if args.output_dir else Path(args.run_dirs[0]) / "report"
    if not args.output_dir and len(args.run_dirs) > 1:
        output_dir = Path("report-" + "-vs-".join(Path(directory).resolve().name for directory in args.run_dirs))
    report = write_report(args.run_dirs, output_dir, labels=args.labels, html=args.html, top_tokens=args.top_tokens)
    for run in report.runs:
        print("\n".join(console_lines(run)))
    for note in report.notes:
        print(f"note: {note}")
    print(f"report: {report.markdown}")
    if report.html is not None:
        print(f"html:   {report.html}")
    for path in report.figures.values():
        print(f"figure: {path}")
    return 0


def parse_eval_args(argv: list[str]):
    """An `EvalConfig` from the command line; a ``--config FILE.yaml``'s keys are checked and set the defaults."""
    from trl import TrlParser

    from ..evaluation import EvalConfig, EvalConfigError
    from .config_file import ConfigFileKind, apply_config, parser_actions, read_config_flag, suggest

    kind = ConfigFileKind(EVAL, "config file", "whose keys are the options of `stapo-trl eval -h`", EvalConfigError)
    path, values, cli_args = read_config_flag(argv, kind)
    parser = TrlParser(dataclass_types=[EvalConfig], prog=EVAL)
    parser.set_defaults_with_config(**apply_config(parser, values, str(path), kind))
    config, remaining = parser.parse_args_into_dataclasses(args=cli_args, return_remaining_strings=True)
    if remaining:
        unknown = next((token for token in remaining if token.startswith("--")), remaining[0])
        raise EvalConfigError(
            f"Unknown arguments: {' '.join(remaining)}."
            + suggest(unknown.lstrip("-").split("=", 1)[0], parser_actions(parser))
            + f" Run `{EVAL} -h` for every option."
        )
    return config


def eval_command(argv: list[str]) -> int:
    """`stapo-trl eval`: avg@k of a model on the paper's benchmarks, with the paper's numbers beside ours."""
    from .. import evaluation
    from .help import eval_help

    if eval_help(argv):
        return 0
    try:
        config = parse_eval_args(argv)
        result = evaluation.evaluate(config)
    except FileNotFoundError as error:
        if isinstance(error, UsageError):
            raise
        raise evaluation.EvalConfigError(str(error)) from error
    except KeyboardInterrupt:
        print(
            f"\n{EVAL}: interrupted. Every finished batch of samples is saved in the output directory; run the same "
            "command again to resume.",
            file=sys.stderr,
        )
        return 130
    print()
    graders = result.summary["graders"]
    for setting in result.summary["settings"]:  # per benchmark: avg@k, the samples, each grader's count, truncations
        print(f"{result.summary['model']['label']} [{setting['name']}: {setting['label']}]")
        for name, score in setting["benchmarks"].items():
            per_grader = ", ".join(f"{grader} {score['grader_correct'][grader]}" for grader in graders)
            answered = ", ".join(f"{grader} {score['grader_answered'][grader]}" for grader in graders)
            status = "" if score["complete"] else f"  (unfinished: {score['samples']}/{score['expected_samples']})"
            print(
                f"  {name:<14} avg@{score['samples_per_problem']:<3} {score['avg_at_k']:6.2f} ± "
                f"{score['standard_error']:.2f}  correct {score['correct']}/{score['samples']} ({per_grader})"
                f"  answer found ({answered})  truncated {score['truncated']}"
                f"  mean length {score['mean_completion_tokens']:.0f} tokens{status}"
            )
    print()
    print(result.table)
    for what, path in result.files.items():
        print(f"{what:<28} {path}")
    return 0


def _version(package: str) -> str:
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return f"{package} not installed"


def _run(command: str, argv: list[str]) -> int:
    """Run ``<command>_command(argv)``, here or in its module, imported now (`stapo-trl -h` loads no torch)."""
    if command == "train":
        from ..cpu.environment import set_cpu_environment

        set_cpu_environment()  # before torch is imported
        from .help import train_help

        if train_help(argv):
            return 0
    if command in ("eval", "report"):
        return (eval_command if command == "eval" else report_command)(argv)
    return getattr(importlib.import_module(f".{command}", __name__), f"{command}_command")(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A mistake in the input (a `UsageError`) becomes one line on stderr and exit code 2 (with its
    traceback under `--traceback` or `STAPO_TRL_TRACEBACK=1`); Ctrl-C exits with 130; any other exception is a bug,
    whose traceback is printed under a line that says how to report it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENVIRONMENT, "") not in ("", "0")
    argv = [token for token in argv if token != TRACEBACK_FLAG]
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command = argv[0]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose one of: {', '.join(COMMANDS)}")
    try:
        return _run(command, argv[1:])
    except UsageError as error:
        if debug:
            traceback.print_exc()
        print(f"stapo-trl {command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"\nstapo-trl {command}: interrupted.", file=sys.stderr)
        return 130
    except Exception:
        versions = ", ".join(map(_version, ("stapo-trl", "trl", "transformers", "torch")))
        print(
            f"stapo-trl {command}: unexpected error. This is a bug in stapo-trl or in a library it uses; please report "
            f"it with the traceback below, the command line and these versions: {versions}.",
            file=sys.stderr,
        )
        raise
