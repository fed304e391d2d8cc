"""`stapo-trl report RUN_DIR [RUN_DIR ...]`: plots and a Markdown summary of training runs, on shared axes."""

from __future__ import annotations

import argparse
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
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
    return parser


def report_command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
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
