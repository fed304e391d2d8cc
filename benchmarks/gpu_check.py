"""The GPU check (issue 35): the statistics kernels against fp64, STAPO against GRPO when nothing is silenced, the S2T
mask on the GPU at the paper's thresholds, and STAPO's cost against GRPO, in bf16 with gradient checkpointing, as the
recipes train. Round two (issue 49): the quickstart recipe on a real model, Liger's Hopper kernel, and GRPO's first
run with cuDNN attention off.

    python benchmarks/gpu_check.py --out OUT_DIR                  # on an H100 or H200: 390 s by default
    python benchmarks/gpu_check.py --device cpu --out OUT_DIR     # toy sizes, the same code paths (CI runs this)
    bash benchmarks/gpu/run_on_device.sh OUT_DIR                  # on the lent GPU machine, with the carried wheels
    python benchmarks/gpu_check.py --sections quickstart kernels first-run --out OUT_DIR      # round two
    python3 benchmarks/gpu/device_run.py "$OUT"                   # round two on the lent machine (benchmarks/gpu/README.md)

Every measurement is printed as it completes, with its target or tolerance and PASS/FAIL, and written to
``OUT_DIR/gpu_check.log``; ``OUT_DIR/gpu_check.json`` is rewritten after each one, so a run killed at its time limit
still leaves what it measured. Each section has a time budget, and the whole run a deadline (``--deadline``): a section
or a measurement that runs out of time is recorded as skipped with the reason, never dropped. The sections:

1. ``kernels``: TRL's fused head (Triton on CUDA), Liger's fused linear cross-entropy with entropy output and our op,
   at Qwen3's vocabulary and 16,384 tokens: error of log p and H against fp64, time and peak memory.
2. ``equivalence``: STAPO with the mask off, and with nothing silenced, against GRPO after 3 steps.
3. ``mask``: a few supervised steps first, then STAPO at the paper's thresholds; the tokens the trainer silenced
   against `spurious_token_mask` on the same step's tensors.
4. ``cost-*``: STAPO/GRPO time per optimizer step and peak memory, alternated runs, at the Qwen3-0.6B and 1.7B shapes.
5. ``quickstart``: the CPU quickstart's recipe through `stapo-trl train` in bf16, STAPO and GRPO alternated: held-out
   accuracy before and after, the silenced share per step, seconds per step and peak memory (`gpu.quickstart`).
6. ``first-run``: GRPO twice in a fresh process with cuDNN attention off, and as torch picks it (`gpu.first_run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from provenance import provenance

REPO = Path(__file__).resolve().parents[1]
STATUSES = ("pass", "fail", "info", "skipped", "not_measured", "not_applicable")


class OutOfTime(Exception):
    """A section, or the whole run, has no time left for what comes next."""


class Terminated(BaseException):
    """SIGTERM arrived (the device command's time limit): record what is done, then stop. A BaseException, like
    KeyboardInterrupt, so that the ``except Exception`` of code it passes through (`stapo-trl train`'s, which would
    report it as a bug) lets it by."""


class Clock:
    """Seconds left before a deadline, on the monotonic clock."""

    def __init__(self, seconds: float, parent: Clock | None = None):
        self.started = time.monotonic()
        end = self.started + seconds
        self.end = min(end, parent.end) if parent is not None else end

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.end - time.monotonic()

    def require(self, seconds: float, what: str) -> None:
        """Raise `OutOfTime` unless ``seconds`` are left for ``what``."""
        if self.left() < seconds:
            raise OutOfTime(f"{what} needs about {seconds:.0f} s; {max(self.left(), 0):.0f} s were left")


class Report:
    """The measurements of one run: printed, appended to the log and written to the JSON as each one completes."""

    def __init__(self, out: Path, header: dict, clock: Clock):
        self.out = out
        self.clock = clock
        self.data = {**header, "sections": [], "summary": {}}
        self.log = open(out / "gpu_check.log", "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def say(self, line: str) -> None:
        stamped = f"[{self.clock.elapsed():6.1f}s] {line}"
        print(stamped, flush=True)
        self.log.write(stamped + "\n")

    def open_section(self, name: str, budget: float) -> dict:
        section = {"name": name, "status": "running", "budget_s": budget, "seconds": None, "reason": None}
        section["measurements"] = []
        self.data["sections"].append(section)
        self.say(f"== {name} (budget {budget:.0f} s, {self.clock.left():.0f} s left in the run)")
        self.write()
        return section

    def close_section(self, section: dict, status: str, seconds: float, reason: str | None = None) -> None:
        section.update(status=status, seconds=round(seconds, 1), reason=reason)
        self.say(f"== {section['name']}: {status.upper()} in {seconds:.1f} s" + (f" ({reason})" if reason else ""))
        self.write()

    def write(self) -> None:
        counts = {status: 0 for status in STATUSES}
        for section in self.data["sections"]:
            for measurement in section["measurements"]:
                counts[measurement["status"]] += 1
        self.data["summary"] = {
            **counts,
            "elapsed_s": round(self.clock.elapsed(), 1),
            "sections": {section["name"]: section["status"] for section in self.data["sections"]},
        }
        temporary = self.out / "gpu_check.json.tmp"
        temporary.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        temporary.replace(self.out / "gpu_check.json")


class Section:
    """What a section function is handed: its clock (the section's budget, within the run's deadline) and a way to
    record measurements."""

    def __init__(self, name: str, report: Report, clock: Clock, entry: dict, device: str):
        self.name = name
        self.report = report
        self.clock = clock
        self.entry = entry
        self.device = device

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    def record(
        self, name: str, value, unit: str, target: str, passed: bool | None, note: str = "", status: str | None = None
    ):
        """One figure with its target or tolerance. ``passed`` None records it as information (what ran, what it
        was); ``status`` records it as skipped, not_measured or not_applicable instead."""
        status = status or ("info" if passed is None else "pass" if passed else "fail")
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        measurement = {"name": name, "value": _plain(value), "unit": unit, "target": target, "status": status}
        if note:
            measurement["note"] = note
        self.entry["measurements"].append(measurement)
        shown = _show(value)
        self.report.say(
            f"[{self.name}] {name}: {shown}{' ' + unit if unit and shown != '-' else ''} | {target or '-'} | "
            f"{status.upper()}" + (f" | {note}" if note else "")
        )
        self.report.write()

    def skip(self, name: str, reason: str) -> None:
        self.record(name, None, "", "", None, reason, status="skipped")

    def note(self, key: str, value) -> None:
        """A fact about the section (sizes, settings, which path ran), kept in the JSON beside its measurements."""
        self.entry.setdefault("facts", {})[key] = _plain(value)
        self.report.write()


def _plain(value):
    """JSON-friendly: NaN and infinities as strings, 0-dimensional tensors as numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())
    return value


def _show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


FIRST_CHECK = ["kernels", "equivalence", "mask", "cost"]
ROUND_TWO = ["quickstart", "kernels", "first-run"]


def section_names(plan, selected: list[str]) -> list[str]:
    """The sections a run will go through: setup, then those ``--sections`` selects, in the order it names them
    (``cost`` selects every ``cost-*`` shape)."""
    names = [
        "kernels",
        "equivalence",
        "mask",
        *[f"cost-{shape.name}" for shape in plan.cost_shapes],
        "quickstart",
        "first-run",
    ]
    unknown = [choice for choice in selected if not any(_selected(name, [choice]) for name in names)]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; the sections are {', '.join(names)}")
    ordered = [name for choice in selected for name in names if _selected(name, [choice])]
    return ["setup", *dict.fromkeys(ordered)]


def run_sections(report: Report, run_clock: Clock, plan, device: str, names: list[str], environment: dict) -> None:
    from gpu import cost, equivalence, first_run, kernels, mask, quickstart, setup

    functions = {
        "setup": setup.run,
        "kernels": kernels.run,
        "equivalence": equivalence.run,
        "mask": mask.run,
        "quickstart": quickstart.run,
        "first-run": first_run.run,
    }
    functions.update({f"cost-{shape.name}": cost.runner(shape) for shape in plan.cost_shapes})
    for name in names:
        run_section(report, run_clock, plan, device, name, functions[name], environment)


def record_unstarted(report: Report, names: list[str], reason: str) -> None:
    started = {section["name"] for section in report.data["sections"]}
    for name in names:
        if name not in started:
            report.close_section(report.open_section(name, 0.0), "skipped", 0.0, reason)


def _selected(name: str, selected: list[str]) -> bool:
    return any(name == choice or name.startswith(f"{choice}-") for choice in selected)


def run_section(report: Report, run_clock: Clock, plan, device: str, name: str, function, environment: dict) -> None:
    budget = plan.budgets.get(name, plan.budgets["cost"])
    record = report.open_section(name, budget)
    started = time.monotonic()
    if run_clock.left() < plan.minimum_section_s and name != "setup":
        report.close_section(record, "skipped", 0.0, f"the run's deadline: {run_clock.left():.0f} s were left")
        return
    section = Section(name, report, Clock(budget, parent=run_clock), record, device)
    try:
        function(section, plan, environment)
        statuses = {m["status"] for m in record["measurements"]}
        status = "failed" if "fail" in statuses else "incomplete" if "skipped" in statuses else "passed"
        report.close_section(record, status, time.monotonic() - started)
    except OutOfTime as reason:
        report.close_section(record, "incomplete", time.monotonic() - started, f"out of time: {reason}")
    except Terminated:
        report.close_section(record, "interrupted", time.monotonic() - started, "SIGTERM (the time limit)")
        raise
    except Exception as error:  # a section that breaks is recorded, and the next one runs
        record["traceback"] = traceback.format_exc()[-4000:]
        report.close_section(record, "error", time.monotonic() - started, f"{type(error).__name__}: {error}")
    finally:
        _free_device_memory(device)


def _free_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: toy sizes, same code paths")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default: the plan's)")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=FIRST_CHECK,
        help=f"which sections to run, in this order (the first check: {' '.join(FIRST_CHECK)}; round two: "
        f"{' '.join(ROUND_TWO)})",
    )
    parser.add_argument("--commit", default=None, help="the commit, where the checkout has no git (the device copy)")
    parser.add_argument(
        "--payload",
        type=Path,
        default=None,
        help="the join status of the files sent in parts (gpu/parts.py; device_run.py writes it): where the model is",
    )
    args = parser.parse_args()

    sys.path.insert(1, str(REPO))
    if args.device == "cuda":
        # Before the first cuBLAS handle: the equivalence section turns on deterministic algorithms.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        from stapo_trl.cpu.environment import set_cpu_environment

        set_cpu_environment()  # before torch loads, as `stapo-trl train` does (the quickstart section calls it later)
    from gpu.plan import plan_for

    plan = plan_for(args.device)
    try:
        names = section_names(plan, args.sections)
    except ValueError as error:
        parser.error(str(error))
    deadline = args.deadline if args.deadline is not None else plan.deadline_s
    run_clock = Clock(deadline)
    args.out.mkdir(parents=True, exist_ok=True)

    header_provenance = provenance()
    if args.commit:
        header_provenance["commit"] = args.commit
    payload = json.loads(args.payload.read_text()) if args.payload is not None else None
    header = {
        "check": "gpu_check",
        "device_mode": args.device,
        "command": " ".join(["python", *sys.argv]),
        "deadline_s": deadline,
        "plan": plan.describe(),
        "provenance": header_provenance,
        "payload": payload,
    }
    report = Report(args.out, header, run_clock)
    report.say(f"gpu_check on {args.device}, deadline {deadline:.0f} s, sections {' '.join(args.sections)}")

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the rest of the run writes what it has
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)
    environment = {"out": args.out, "payload": payload}
    try:
        run_sections(report, run_clock, plan, args.device, names, environment)
    except Terminated:
        record_unstarted(report, names, "not started: SIGTERM")
        report.say("stopped by SIGTERM; the JSON holds what was measured")
    report.data["complete"] = all(s["status"] in ("passed", "failed") for s in report.data["sections"])
    report.write()
    summary = report.data["summary"]
    report.say(
        "done: "
        + ", ".join(f"{summary[status]} {status}" for status in STATUSES if summary[status])
        + f"; sections: {', '.join(f'{name} {status}' for name, status in summary['sections'].items())}"
    )
    report.say(f"results: {args.out / 'gpu_check.json'}")
    broken = summary["fail"] or any(status == "error" for status in summary["sections"].values())
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
