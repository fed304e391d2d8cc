"""The fused LM head alone, on the quickstart's shapes: TRL's CPU fallback against stapo-trl's CPU head.

    python benchmarks/bench_cpu_head.py [--tokens 1675] [--all_positions 6624] [--repeats 3]

One training forward and backward of the head as GRPO runs it on SmolLM2-135M (H = 576, V = 49152, fp32): the head's
weight frozen (LoRA; SmolLM2 ties it to the embeddings), the gradient taken through the log-probabilities and the
entropy computed for logging only. Rows:

- ``trl, every position``: TRL's fallback as `add_fused_lm_head` runs it on the CPU, on all ``--all_positions``
  (prompt and padding included);
- ``trl, labelled positions``: TRL's fallback on the ``--tokens`` labelled positions only;
- ``cpu head``: stapo-trl's `CPULogProbEntropy` on the labelled positions, with the logits kept for the backward and
  with them recomputed, for a few block sizes.

Each row runs in a fresh subprocess; the figure is the best of ``--repeats`` runs after one warm-up, in process CPU
time (user + system) and wall time, with the peak RSS growth over the run (VmHWM reset before it). The floor is the
time of the two GEMMs the job needs (forward: ``[N, H] x [H, V]`` over the labelled tokens; backward: the hidden-state
gradient, as large), at the GEMM rate measured in the same subprocess on that shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from provenance import cpu_model, provenance

HIDDEN, VOCAB = 576, 49152


def run_case(case: dict) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peak_rss import peak_growth_mib, reset_peak_rss

    torch.manual_seed(0)
    tokens = case["tokens"]
    hidden = torch.randn(tokens, HIDDEN) * 0.5
    weight = torch.randn(VOCAB, HIDDEN) * 0.05
    targets = torch.randint(0, VOCAB, (tokens,))
    grad = torch.randn(tokens)

    if case["op"] == "trl":
        from trl.kernels import ChunkedLogProbFunction

        def step(h):
            log_probs, entropies, *_ = ChunkedLogProbFunction.apply(
                h, weight, None, targets, 1.0, 32768, None, 1.0, ("entropy",)
            )
            return log_probs, entropies
    else:
        from stapo_trl.core.token_stats.torch_backend import cpu_logprob_entropy

        def step(h):
            return cpu_logprob_entropy(
                h, weight, targets, block_rows=case["block_rows"], keep_logits_bytes=case["keep_logits_bytes"]
            )

    def once():
        h = hidden.clone().requires_grad_()
        started_cpu, started_wall = time.process_time(), time.perf_counter()
        log_probs, entropies = step(h)
        forward = (time.process_time() - started_cpu, time.perf_counter() - started_wall)
        entropies.detach().sum()
        (log_probs * grad).sum().backward()
        total = (time.process_time() - started_cpu, time.perf_counter() - started_wall)
        return forward, total

    once()
    rss = reset_peak_rss()
    runs = [once() for _ in range(case["repeats"])]
    peak = peak_growth_mib(rss)
    best = min(runs, key=lambda run: run[1][0])

    a, b = torch.randn(case["tokens"], HIDDEN), torch.randn(HIDDEN, VOCAB)
    out = torch.empty(case["tokens"], VOCAB)
    torch.mm(a, b, out=out)
    gemm = min(
        (lambda started: (torch.mm(a, b, out=out), time.process_time() - started)[1])(time.process_time())
        for _ in range(3)
    )
    return {
        **case,
        "forward_cpu_s": round(best[0][0], 3),
        "forward_wall_s": round(best[0][1], 3),
        "total_cpu_s": round(best[1][0], 3),
        "total_wall_s": round(best[1][1], 3),
        "peak_rss_growth_mib": round(peak),
        "gemm_cpu_s": round(gemm, 3),
        "gemm_gflop_per_cpu_s": round(2 * case["tokens"] * HIDDEN * VOCAB / gemm / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1675)
    parser.add_argument("--all_positions", type=int, default=6624)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block_rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return

    cases = [
        {"label": "trl, every position", "op": "trl", "tokens": args.all_positions},
        {"label": "trl, labelled positions", "op": "trl", "tokens": args.tokens},
    ]
    for block_rows in args.block_rows:
        for keep, name in ((1 << 30, "logits kept"), (0, "recomputed")):
            cases.append(
                {
                    "label": f"cpu head, {name}, blocks of {block_rows}",
                    "op": "cpu_head",
                    "tokens": args.tokens,
                    "block_rows": block_rows,
                    "keep_logits_bytes": keep,
                }
            )
    results = []
    for case in cases:
        case["repeats"] = args.repeats
        output = subprocess.run(
            [sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True, check=True
        ).stdout
        result = json.loads(output.strip().splitlines()[-1])
        results.append(result)
        print(
            f"{result['label']:<40} N={result['tokens']:>5}  fwd {result['forward_cpu_s']:6.2f} s  "
            f"fwd+bwd {result['total_cpu_s']:6.2f} s CPU ({result['total_wall_s']:.2f} s wall)  "
            f"peak +{result['peak_rss_growth_mib']} MiB  GEMM {result['gemm_gflop_per_cpu_s']} GFLOP/CPU-s",
            flush=True,
        )
    floor = 2 * next(result["gemm_cpu_s"] for result in results if result["tokens"] == args.tokens)
    print(f"floor (one forward and one backward GEMM over {args.tokens} tokens): {floor:.2f} s CPU")
    if args.output:
        from importlib.metadata import version

        record = {
            "provenance": provenance(),
            "date": datetime.date.today().isoformat(),
            "machine": {
                "cpu_model": cpu_model(),
                "cores": os.cpu_count(),
                "load_average_after": list(os.getloadavg()),
            },
            "versions": {name: version(name) for name in ("torch", "trl")},
            "shape": {"hidden": HIDDEN, "vocab": VOCAB, "tokens": args.tokens, "all_positions": args.all_positions},
            "floor_cpu_s": round(floor, 3),
            "rows": results,
        }
        args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
