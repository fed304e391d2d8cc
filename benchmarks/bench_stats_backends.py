"""Time and peak memory of the statistics backends against naive logits (training forward + backward).

Each measurement runs in a fresh subprocess; peak memory is the growth of the process's peak RSS (VmHWM, reset
through /proc/self/clear_refs) above the RSS held before the call, inputs included in neither.

    python benchmarks/bench_stats_backends.py --out docs/benchmarks/stats_backends.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

from peak_rss import peak_growth_mib, reset_peak_rss
from provenance import provenance

SHAPES = [
    {"name": "design", "tokens": 4096, "hidden": 256, "vocab": 32000},
    {"name": "smollm2", "tokens": 4096, "hidden": 576, "vocab": 49152},
]
METHODS = ["naive", "torch", "liger", "trl_fused_head"]


def measure(method: str, tokens: int, hidden: int, vocab: int, repeats: int) -> dict:
    import torch

    from stapo_trl.core.token_stats.backends import BACKENDS

    torch.manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, requires_grad=True)
    weight = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    function = BACKENDS[method]

    def step():
        log_probs, entropies = function(hidden_states, weight, targets)
        (log_probs.sum() + 0.1 * entropies.sum()).backward()
        hidden_states.grad = None
        weight.grad = None

    step()  # warm-up: imports, allocator
    times = []
    peaks = []
    for _ in range(repeats):
        before = reset_peak_rss()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(peak_growth_mib(before))
    return {"seconds": min(times), "seconds_all": times, "peak_mib": max(peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", nargs=4, metavar=("METHOD", "TOKENS", "HIDDEN", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, tokens, hidden, vocab = args.worker
        print(json.dumps(measure(method, int(tokens), int(hidden), int(vocab), args.repeats)))
        return

    import torch

    results = {"machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()}, "runs": []}
    for shape in SHAPES:
        for method in METHODS:
            command = [sys.executable, __file__, "--repeats", str(args.repeats), "--worker", method]
            command += [str(shape["tokens"]), str(shape["hidden"]), str(shape["vocab"])]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            run = {**shape, "method": method, **json.loads(output.strip().splitlines()[-1])}
            results["runs"].append(run)
            print(
                f"{shape['name']:8s} N={shape['tokens']} H={shape['hidden']} V={shape['vocab']} {method:6s} "
                f"{run['seconds']:7.2f} s  {run['peak_mib']:8.0f} MiB",
                flush=True,
            )
    if args.out:
        results = {"provenance": provenance(), **results}
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
