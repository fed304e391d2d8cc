"""How long `stapo-trl train` takes to refuse a bad recipe: wall time from process start to exit, for one mistake of
each kind that is checked before a model loads.

    python benchmarks/bench_first_error.py --repeats 3

Each case is a fresh `python -m stapo_trl train ...` process (imports included). Results go to
docs/benchmarks/first_error.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from provenance import provenance

REPO = Path(__file__).resolve().parents[1]


def recipe(directory: Path, **keys) -> Path:
    values = {
        "model_name_or_path": str(directory / "no-model"),
        "dataset_name": "sample",
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "output_dir": str(directory / "run"),
        **keys,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


CASES = {
    "unknown key": lambda d: ["--config", str(recipe(d, learning_rte=1e-6))],
    "prompt style against reward": lambda d: ["--config", str(recipe(d, reward_funcs=["dapo"]))],
    "output_dir holds a finished run": lambda d: (
        (d / "run").mkdir(exist_ok=True),
        (d / "run" / "run_summary.json").write_text("{}"),
        ["--config", str(recipe(d))],
    )[-1],
    "resume without a checkpoint": lambda d: ["--config", str(recipe(d, resume_from_checkpoint="last"))],
    "model path missing": lambda d: ["--config", str(recipe(d))],
    "use_vllm without vLLM": lambda d: ["--config", str(recipe(d, use_vllm=True))],
}


def run_case(name: str) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory() as scratch:
        arguments = CASES[name](Path(scratch))
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "stapo_trl", "train", *arguments], capture_output=True, text=True, cwd=REPO
        )
        seconds = time.perf_counter() - started
    return seconds, result.returncode, result.stderr.strip().splitlines()[-1][:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="a note on the machine's load while this ran")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "first_error.json")
    args = parser.parse_args()

    results = {}
    for name in CASES:
        runs = [run_case(name) for _ in range(args.repeats)]
        seconds = [run[0] for run in runs]
        results[name] = {
            "median_seconds": round(statistics.median(seconds), 2),
            "max_seconds": round(max(seconds), 2),
            "exit_code": runs[0][1],
            "message": runs[0][2],
        }
        print(f"{name:<34} exit {runs[0][1]}  median {statistics.median(seconds):5.2f} s  max {max(seconds):5.2f} s")
    output = {
        "provenance": provenance(),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "note": args.note,
        "repeats": args.repeats,
        "cases": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
