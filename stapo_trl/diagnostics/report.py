"""`stapo-trl report`: what it reads of each run directory (its log, which one: docs/diagnostics.md; its dump and
record) and the ``report.md`` (and ``report.html``) it writes, with :mod:`.report_figures`' figures."""

from __future__ import annotations

import itertools
import json
import math
from base64 import b64encode
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..core.names import TRAINER_STATE_FILE
from ..core.resume import last_complete_checkpoint
from ..core.token_rules import registered_rules
from ..file_and_metric_names import HELDOUT_RESULTS_FILE, METRICS_FILE
from ..storage import read_json_lines
from .report_figures import FIGURE_TITLES, plot_report_figures
from .run_record import (
    RunRecord,
    build_run_record,
    is_training_record,
    rule_summary_line,
    silenced_token_line,
    trend_sentences,
)
from .token_dump import read_dump


class ReportError(UsageError, ValueError):
    """A run directory that cannot be reported on, with what is missing and how to get it."""


@dataclass
class RunLogs:
    """What one run directory holds for the report."""

    label: str
    directory: Path
    history: list[dict[str, Any]]
    """The log's training steps (`read_history`), which the figures draw."""
    source: Path
    record: RunRecord
    """The run's facts, built from the whole log and the dump, which the tables and text show."""
    silenced_tokens: list[dict[str, Any]] | None = None
    dump_stats: dict[str, Any] | None = None


def find_log_source(directory: Path) -> Path | None:
    """The run's log: its ``trainer_state.json``, the newest checkpoint's, or ``metrics.jsonl``; None if none is."""
    if (own := directory / TRAINER_STATE_FILE).is_file():
        return own
    if (checkpoint := last_complete_checkpoint(directory)) is not None:
        return checkpoint / TRAINER_STATE_FILE
    return metrics if (metrics := directory / METRICS_FILE).is_file() else None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file but its final summary (and a last line cut off mid-write)."""
    return [record for record in read_json_lines(path) if "train_runtime" not in record]


def read_log(source: Path) -> list[dict[str, Any]]:
    """Every record of a ``trainer_state.json``'s log history or of a ``metrics.jsonl``."""
    try:
        is_metrics = source.name == METRICS_FILE
        return read_json_lines(source) if is_metrics else json.loads(source.read_text()).get("log_history", [])
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise ReportError(
            f"{source} cannot be read ({error}); the file is damaged. Point the report at a checkpoint-N/ of the run, "
            "whose trainer_state.json holds the log up to that step."
        ) from None


def _steps(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in log if "step" in record and is_training_record(record)]


def read_history(source: Path) -> list[dict[str, Any]]:
    """The training steps of a ``trainer_state.json`` or ``metrics.jsonl`` (`is_training_record`)."""
    return _steps(read_log(source))


def load_run(directory: str | Path, label: str | None = None) -> RunLogs:
    """Read one run directory, or raise `ReportError` saying what is missing (`DamagedFileError`: a damaged dump)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory}: no such directory.")
    if (source := find_log_source(directory)) is None:
        raise ReportError(
            f"{directory}: no training log found. The report reads {TRAINER_STATE_FILE} (written at the end of "
            f"`stapo-trl train`, by `trainer.save_state()`, and in every checkpoint-N/) or {METRICS_FILE} (written "
            "by `stapo-trl train`). Point it at a training output_dir, or call trainer.save_state() after "
            "trainer.train() in your own script."
        )
    log = read_log(source)
    if not (history := _steps(log)):
        raise ReportError(
            f"{source}: the log holds no training steps. Was the run stopped before its first logging step "
            "(logging_steps)?"
        )
    silenced_tokens, dump_stats = read_dump(directory)
    record = build_run_record(log, silenced_tokens=silenced_tokens, dump_stats=dump_stats)
    return RunLogs(label or directory.resolve().name, directory, history, source, record, silenced_tokens, dump_stats)


HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
    "table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px}"
    "th{background:#f3f3f3}code{background:#f6f6f6;padding:1px 3px}img{max-width:100%}"
    "blockquote{color:#555;border-left:3px solid #ccc;margin-left:0;padding-left:1em}"
)


@dataclass
class Report:
    """The files a report wrote, and the runs it read (each with its record)."""

    output_dir: Path
    figures: dict[str, Path]
    markdown: Path
    runs: list[RunLogs]
    notes: list[str] = field(default_factory=list)
    html: Path | None = None


def _cell(value: Any, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def _summary_table(runs: list[RunLogs]) -> str:
    def quarters(record: RunRecord, key: str, pattern: str) -> str:
        trend = record.trends.get(key)
        return (
            "–" if trend is None else " → ".join(pattern.format(trend[q]) for q in ("first_quarter", "last_quarter"))
        )

    header = (
        "| run | steps | reward (first → last quarter) | entropy (first → last quarter) | silenced fraction | "
        "silenced tokens | candidates | median threshold | grad norm, median (max) | clipped tokens | "
        "held-out accuracy (before → after) | dump written / silenced |"
    )
    lines = [header, "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for run in runs:
        record = run.record
        silencing = record.silencing_summary()
        grad_norm = record.optimization.get("grad_norm")
        grad = f"{grad_norm['median']:.3g} ({grad_norm['max']:.3g})" if grad_norm else "–"
        clipped = record.optimization.get("clip_ratio/region_mean", {}).get("mean")
        dump = f"{record.dump['written']} / {record.dump['silenced']}" if record.dump else "–"
        lines.append(
            f"| {run.label} | {record.steps} | {quarters(record, 'reward', '{:+.3f}')} "
            f"| {quarters(record, 'entropy', '{:.3f}')} | {_cell(silencing.get('silenced_fraction'), '{:.4%}')} "
            f"| {_cell(silencing.get('silenced_tokens'), '{}')} | {_cell(silencing.get('candidates'), '{}')} "
            f"| {_cell(silencing.get('threshold_median'), '{:.3f}')} | {grad} | {_cell(clipped, '{:.2%}')} "
            f"| {heldout_cell(record)} | {dump} |"
        )
    return "\n".join(lines)


def heldout_cell(record: RunRecord) -> str:
    """Held-out accuracy before → after, ± the binomial standard error, or – when not logged."""
    cells = [
        f"{entry['accuracy']:.3f}" + (f" ± {error:.3f}" if (error := entry.get("standard_error")) is not None else "")
        for entry in (record.accuracy_before, record.accuracy_after)
        if entry is not None
    ]
    return " → ".join(cells) or "–"


def rule_lines(record: RunRecord) -> list[str]:
    """Each rule's summary line in apply order, applied or in shadow, as the end-of-run summary prints it."""
    return [
        f"{prefix}{found[0]}: {found[1]}"
        for spec in registered_rules()
        for shadow, prefix in ((False, ""), (True, "in shadow (computed, not applied): "))
        if (found := rule_summary_line(record, spec, shadow)) is not None
    ]


def console_lines(run: RunLogs) -> list[str]:
    """What `stapo-trl report` prints for one run: its steps, trends, rule summaries and held-out accuracy."""
    record = run.record
    lines = [f"{run.label}: {record.steps} steps"]
    lines += [f"  {line}" for line in [*trend_sentences(record), *rule_lines(record)]]
    if record.accuracy_before or record.accuracy_after:
        lines.append(f"  held-out greedy accuracy: {heldout_cell(record)}")
    return lines


def paired_heldout(runs: list[RunLogs]) -> list[str]:
    """Per pair of runs with ``heldout_results.jsonl`` on the same problems: what each solved alone; a sign test."""
    found = {
        run.label: read_json_lines(path) for run in runs if (path := run.directory / HELDOUT_RESULTS_FILE).is_file()
    }
    results = {label: rows for label, rows in found.items() if rows and all("after_correct" in row for row in rows)}
    lines = []
    for first, second in itertools.combinations(results, 2):
        a, b = results[first], results[second]
        if [record["solution"] for record in a] != [record["solution"] for record in b]:
            lines.append(f"- {first} and {second} were evaluated on different held-out problems: not compared.")
            continue
        pairs = [(bool(x["after_correct"]), bool(y["after_correct"])) for x, y in zip(a, b, strict=True)]
        only_a, only_b = sum(x and not y for x, y in pairs), sum(y and not x for x, y in pairs)
        solved_a, solved_b = sum(x for x, _ in pairs), sum(y for _, y in pairs)
        verdict, total = "They agree on every problem.", only_a + only_b
        if total:  # an exact two-sided sign test (McNemar's) on the discordant problems
            p_value = min(1.0, 2 * sum(math.comb(total, k) for k in range(min(only_a, only_b) + 1)) / 2**total)
            reading = "a difference beyond chance" if p_value < 0.05 else "within chance"
            verdict = f"Exact sign test on the {total} problems they disagree on: p = {p_value:.2g}, {reading}."
        lines.append(
            f"- {first} solved {solved_a} and {second} {solved_b} of the same {len(a)} problems after training; "
            f"{only_a} were solved by {first} alone and {only_b} by {second} alone. " + verdict
        )
    return lines


def write_report(
    run_dirs: list[str | Path],
    output_dir: str | Path,
    *,
    labels: list[str] | None = None,
    html: bool = False,
    top_tokens: int = 15,
) -> Report:
    """Read the runs, draw the figures into ``output_dir`` and write ``report.md`` (and ``report.html``)."""
    if not run_dirs:
        raise ReportError("Give at least one run directory.")
    directories = [Path(directory).resolve() for directory in run_dirs]
    if labels is not None and len(labels) != len(directories):
        raise ReportError(f"--labels gives {len(labels)} labels for {len(directories)} run directories.")
    if labels is None:
        labels = [directory.name for directory in directories]
        if len(set(labels)) < len(labels):
            labels = [f"{directory.parent.name}/{directory.name}" for directory in directories]
    runs = [load_run(directory, label) for directory, label in zip(run_dirs, labels, strict=True)]
    output_dir = Path(output_dir)
    figures = plot_report_figures(runs, output_dir, top_tokens)
    notes = []
    if "token_density" not in figures:
        notes.append(
            "No run has a silenced-token dump, so the p-H density and the top silenced tokens are left out. Train with "
            "`dump_silenced_tokens: true` to get them."
        )
    for run in runs:
        if run.record.silencing_rule() is None:
            shadow = run.record.shadow_token_rules
            why = "none was applied; the rules in shadow are summarized below" if shadow else "none was on"
            notes.append(f"{run.label}: no token rule silenced tokens in the log ({why}).")
    report = Report(output_dir, figures, output_dir / "report.md", runs, notes)
    report.markdown.write_text(_markdown(runs, notes, figures, embed=False))
    if html:
        import markdown

        body = markdown.markdown(_markdown(runs, notes, figures, embed=True), extensions=["tables"])
        report.html = output_dir / "report.html"
        report.html.write_text(
            "<!doctype html><html><head><meta charset='utf-8'><title>stapo-trl report</title>"
            f"<style>{HTML_STYLE}</style></head><body>\n{body}\n</body></html>\n"
        )
    return report


def _markdown(runs: list[RunLogs], notes: list[str], figures: dict[str, Path], embed: bool) -> str:
    lines = ["# stapo-trl report", ""]
    lines += [f"- **{run.label}**: `{run.directory}` (log: `{run.source.name}`)" for run in runs]
    lines += ["", _summary_table(runs), ""]
    lines += [f"> {note}\n" for note in notes]
    lines += [
        "## Trends and what the rules did",
        "",
        "A trend is the least-squares slope against the step, ± its standard error; it is called a rise or a fall "
        "only beyond twice that error. The same sentences are in the run's end-of-run summary and model card.",
        "",
    ]
    for run in runs:
        record = run.record
        lines += [f"**{run.label}**", ""]
        lines += [f"- {line}" for line in (*trend_sentences(record), *rule_lines(record))]
        if (share := record.optimization.get("gradient_probe/silenced_grad_sq_share")) is not None:
            tokens = record.optimization.get("gradient_probe/silenced_token_share")
            lines.append(
                "- gradient probe: the silenced tokens (for a rule in shadow, the tokens it would silence) carried "
                f"{share['mean']:.2%} of the squared gradient norm on average over {share['steps']} probed steps"
                + (f", for {tokens['mean']:.2%} of the loss tokens" if tokens else "")
            )
        if (length := record.optimization.get("completions/mean_length")) is not None:
            lines.append(f"- mean completion length: {length['mean']:.1f} tokens over the run")
        lines.append("")
    if comparison := paired_heldout(runs):
        lines += ["## Held-out problems, run against run", "", *comparison, ""]
    for name, path in figures.items():
        image = f"data:image/png;base64,{b64encode(path.read_bytes()).decode()}" if embed else path.name
        lines += ["", f"## {FIGURE_TITLES[name]}", "", f"![{FIGURE_TITLES[name]}]({image})"]
    if with_dump := [run for run in runs if run.dump_stats is not None]:
        lines += ["", "## Silenced tokens in context", ""]
        for run in with_dump:
            examples = (run.silenced_tokens or [])[:5]
            lines += [f"**{run.label}**" + ("" if examples else ": none dumped"), ""]
            lines += [f"- {silenced_token_line(record)}" for record in examples] + [""]
    return "\n".join(lines).rstrip() + "\n"
