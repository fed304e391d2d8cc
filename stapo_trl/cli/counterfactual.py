"""`stapo-trl counterfactual RUN_DIR`: apply a run's saved generations again under each arm, read what each update did
to the policy (`stapo_trl.research.counterfactual.study`) and write the paired differences (docs/counterfactual.md)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

RECORDS_FILE = "records.jsonl"
FIGURE_FILE = "counterfactual.png"
SUMMARY_FILE = "summary.json"
TABLE_FILE = "table.md"


def counterfactual_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="stapo-trl counterfactual",
        description="Apply every saved generation of a run again, once per arm (which tokens each step silences), on "
        "the same completions and dropout masks, and read each update on held-out prompts: entropy change, KL, log p "
        "of correct responses, update norm. The run must have been trained with generation_states_every (one "
        "process; for GRPO with shadow_token_rules: [s2t]). Run it again after an interruption to continue.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `stapo-trl train` output directory with saved states")
    parser.add_argument("--output_dir", help="where results go (default RUN_DIR/counterfactual)")
    parser.add_argument("--arms", nargs="+", help="arms to run, by name (default: all; 'none' always runs)")
    parser.add_argument("--probe_problems", type=int, default=32, help="held-out problems in each probe set")
    parser.add_argument("--max_generations", type=int, help="only the first this many saved ones")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampled responses and the random arm")
    args = parser.parse_args(argv)
    from ..research.counterfactual.study import CounterfactualError, CounterfactualOptions

    given = {name: getattr(args, name) for name in ("probe_problems", "max_generations", "seed")}
    for flag in ("probe_problems", "max_generations"):
        if given[flag] is not None and given[flag] < 1:
            raise CounterfactualError(f"--{flag} is {given[flag]}; it must be at least 1.")
    run_dir = Path(args.run_dir)
    output_dir = Path(args.output_dir) if args.output_dir else run_dir / "counterfactual"
    options = CounterfactualOptions(arms=tuple(args.arms or CounterfactualOptions.arms), **given)
    records = run_counterfactual(run_dir, output_dir, options)
    summary = write_summary(records, output_dir, f"Counterfactual updates of {run_dir.name}, after each generation")
    primary = summary["primary"]
    print(
        f"{summary['generations']} generations replayed, {summary['generations_with_silenced_tokens']} where "
        f"{summary['reference_arm']} silenced tokens ({summary['silenced_tokens']} in all); replaying the recorded "
        f"updates: largest difference {summary['reproduction_max_abs_difference']}"
    )
    if primary["n"]:
        print(
            f"{primary['measure']}, {primary['comparison']}, after each generation: mean {primary['mean']:+.3g}"
            + (f", 95% interval [{primary['low']:+.3g}, {primary['high']:+.3g}]" if primary["low"] is not None else "")
            + f" over {primary['n']} generations"
        )
        own = summary["none_over_the_same_generations"][primary["point"]][primary["measure"]]
        print(f"  beside none's own {primary['measure']} over the same generations: mean {own['mean']:+.3g}")
    for name in (TABLE_FILE, SUMMARY_FILE, FIGURE_FILE, RECORDS_FILE):
        print(f"{name}: {output_dir / name}")
    return 0


def write_summary(records_path: Path, output_dir: Path, title: str) -> dict:
    """Summarize ``records_path`` into ``summary.json``, ``table.md`` and the figure; return the summary."""
    from ..diagnostics.plotting import DifferencePanel, DifferenceRow, plot_difference_panels
    from ..research.counterfactual.summary import COMPARISONS, MEASURES, summarize, summary_table
    from ..storage import read_json_lines, write_text_atomically

    summary = summarize(read_json_lines(records_path))
    write_text_atomically(output_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    tables = [
        f"After the generation's {name}: first arm minus second, mean [95% interval] (n). Per generation: each "
        "generation in which the first arm had silenced a token by then is one draw; per seed: each run's mean over "
        "those generations is one draw. The last row is the none arm's own value over the generations where s2t "
        "silenced a token.\n\n" + summary_table(summary, point)
        for point, name in (("first_step", "first optimizer step"), ("generation", "last optimizer step"))
    ]
    write_text_atomically(output_dir / TABLE_FILE, "\n\n".join(tables) + "\n")
    by_name = {name: summary["comparisons"][name]["generation"] for name in map(" - ".join, COMPARISONS)}
    shown = {name: cells for name, cells in by_name.items() if cells["entropy_change"]["n"]}  # arms the records hold
    panels = []
    for measure, meaning in MEASURES.items():
        rows = []
        for name, cells in shown.items():
            seeds = cells[measure]["seed_level"]
            cell_values = cells[measure]["values"]
            rows.append(DifferenceRow(name, cell_values, seeds["mean"], seeds["low"], seeds["high"], seeds["values"]))
        panels.append(DifferencePanel(meaning, rows, xlabel="first arm minus second"))
    plot_difference_panels(
        panels,
        output_dir / FIGURE_FILE,
        title=f"{title}\nafter each generation's last optimizer step; dot: a generation in which the first arm silenced a "
        "token; diamond: a run's mean over them; bar: the mean over runs and its 95% interval",
    )
    return summary


def run_counterfactual(run_dir: Path, output_dir: Path, options) -> Path:
    """Replay every complete saved generation of ``run_dir`` under each arm of ``options`` (a `CounterfactualOptions`),
    appending one JSON record per generation and arm to ``output_dir/records.jsonl`` (returned) as each generation
    finishes, skipping those already there."""
    from tqdm.auto import tqdm

    from ..cpu.runtime import cpu_runtime
    from ..research.counterfactual.study import (
        CounterfactualError,
        build_probe_set,
        check_statistics_source,
        recipe_arguments,
        replay_provenance,
        run_generation,
    )
    from ..research.generation_states import saved_generations
    from ..storage import append_text, read_json_lines
    from .recipe import parse_train_args
    from .train import build_trainer

    generations = saved_generations(run_dir)
    if not generations:
        raise CounterfactualError(
            f"{run_dir} holds no complete saved generation ({run_dir}/generation_states/*/generation.json). Train with "
            "generation_states_every: 1 (and, for GRPO, shadow_token_rules: [s2t]) to save them."
        )
    if options.max_generations is not None:
        generations = generations[: options.max_generations]
    output_dir.mkdir(parents=True, exist_ok=True)
    records_path = output_dir / RECORDS_FILE
    done = {(r["generation"], r["arm"]) for r in read_json_lines(records_path)} if records_path.is_file() else set()

    # The run's own recipe, then nothing saved or logged, the problems the policy is read on, and every layer run (the
    # frozen-layer replay would record the probe sets' first layers in one readout and compute them in the next).
    overrides = ["--output_dir", str(output_dir / "trainer"), "--generation_states_every", "0"]
    overrides += ["--dump_silenced_tokens", "false", "--gradient_probe_steps", "0", "--report_to", "none"]
    overrides += ["--heldout_problems", str(options.probe_problems), "--replay_frozen_layers", "false"]
    request = parse_train_args([*recipe_arguments(run_dir), *overrides])
    script, training = request.script, request.training
    check_statistics_source(training, generations)
    provenance = replay_provenance()
    with cpu_runtime(training, lm_head=script.cpu_lm_head, replay_frozen_layers=False) as runtime:
        trainer, tokenizer, heldout = build_trainer(request)
        runtime.attach(trainer)  # the in-place key/value cache for the sampled probe responses
        if heldout is None or len(heldout) == 0:
            raise CounterfactualError("The run's recipe gives no held-out problems to read the policy on.")
        trainer.create_optimizer_and_scheduler(num_training_steps=training.max_steps)
        probe = build_probe_set(tokenizer, heldout, options.probe_problems, script.prompt_style)
        todo = [g for g in generations if any((g.generation, arm) not in done for arm in options.arms)]
        for generation in tqdm(todo, desc="counterfactual updates", unit="generation"):
            for record in run_generation(trainer, generation, probe, options):
                if (record["generation"], record["arm"]) not in done:
                    record["run"] = run_dir.name
                    record["replayed_with"] = provenance
                    append_text(records_path, json.dumps(record) + "\n")
    settings = {"run_dir": str(run_dir), **asdict(options), "arms": list(options.arms)}
    (output_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    return records_path
