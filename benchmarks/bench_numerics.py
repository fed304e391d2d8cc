"""Numerics of the statistics backends: degenerate rows, bf16 against fp32 statistics and the S2T mask, and peak
memory against the number of tokens.

- Degenerate rows: what each backend returns for logits that overflow, are infinite, or come from bf16/fp16 inputs.
- bf16: an LLM-like batch (one boosted token over Gaussian logits, targets sampled from the distribution), statistics
  from fp32 and from bf16 hidden states and weight, errors against fp64, and the S2T mask from each.
- Memory: one training forward and backward per fresh subprocess; peak is how far the process's peak RSS (VmHWM,
  reset through /proc/self/clear_refs after a tiny warm-up) rose above the RSS held with the inputs allocated.

    python benchmarks/bench_numerics.py --out docs/benchmarks/numerics.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time

from peak_rss import peak_growth_mib, reset_peak_rss
from provenance import provenance

BF16_SHAPE = {"tokens": 16384, "hidden": 256, "vocab": 32000, "row": 256}
BF16_BACKENDS = ["torch", "liger", "trl_fused_head"]
MEMORY_SHAPES = [{"hidden": 64, "vocab": 8192}, {"hidden": 256, "vocab": 32000}]
MEMORY_RUNS = [("naive", 4096), ("torch", 4096), ("torch", 32768), ("torch", 131072)]


def degenerate_rows() -> list[dict]:
    import torch

    from stapo_trl.core.token_stats.backends import BACKENDS

    inf = float("inf")
    eye = torch.eye(4)
    cases = [
        ("huge but representable logits [1e30, 0, 0, 0], target 1", [[1e30, 0, 0, 0]], eye, None, 1),
        ("logit spread beyond fp32 [3e38, -3e38, 0, 0], target 1", [[3e38, -3e38, 0, 0]], eye, None, 1),
        ("an infinite hidden state", [[inf, 0, 0, 0]], eye, None, 0),
        ("a -inf bias entry, logits [1, 0.5, 0, -inf], target 0", [[1, 0.5, 0, 0]], eye, [0, 0, 0, -inf], 0),
        ("bf16 inputs whose product overflows fp32 (1e30 x 1e30)", [[1e30, 0, 0, 0]], eye * 1e30, None, 1),
        ("fp16 inputs with logits above 65504 (6e4 x 6e4)", [[6e4, 0, 0, 0]], eye * 6e4, None, 1),
    ]
    rows = []
    for name, hidden, weight, bias, target in cases:
        dtype = torch.bfloat16 if "bf16" in name else torch.float16 if "fp16" in name else torch.float32
        hidden = torch.tensor(hidden, dtype=torch.float32).to(dtype)
        weight = weight.to(dtype)
        bias = None if bias is None else torch.tensor(bias)
        results = {}
        for backend in ["naive", "torch", "trl_fused_head", "liger"]:
            if backend == "liger" and bias is not None:
                results[backend] = "no bias support"
                continue
            with torch.no_grad():
                log_probs, entropies = BACKENDS[backend](hidden, weight, torch.tensor([target]), bias=bias)
            results[backend] = [log_probs.item(), entropies.item()]
        rows.append({"case": name, "log_p_and_entropy": results})
        print(f"{name:60s} " + "  ".join(f"{key}={value}" for key, value in results.items()), flush=True)
    return rows


def llm_like_batch(tokens: int, hidden_size: int, vocab: int, row: int, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    scale = torch.empty(tokens, 1).uniform_(0, math.log(3), generator=generator).exp()
    boost = 4 + 24 * torch.rand(tokens, 1, generator=generator) ** 0.5
    top = torch.randint(0, vocab, (tokens,), generator=generator)
    direction = weight[top] / weight[top].square().sum(-1, keepdim=True)
    hidden = torch.randn(tokens, hidden_size, generator=generator) * scale + boost * direction
    targets = torch.empty(tokens, dtype=torch.long)
    max_logit = 0.0
    for start in range(0, tokens, 1024):
        logits = hidden[start : start + 1024] @ weight.T
        max_logit = max(max_logit, logits.abs().max().item())
        targets[start : start + 1024] = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
    advantages = torch.randn(tokens // row, generator=generator)
    return hidden, weight, targets, advantages, max_logit


def bf16_against_fp32(seeds: int) -> list[dict]:
    import torch

    from stapo_trl import spurious_token_mask
    from stapo_trl.core.token_stats.backends import BACKENDS

    shape = BF16_SHAPE
    log_tau_p = math.log(0.002)
    runs = []
    for seed in range(seeds):
        hidden, weight, targets, advantages, max_logit = llm_like_batch(
            shape["tokens"], shape["hidden"], shape["vocab"], shape["row"], seed
        )
        with torch.no_grad():
            exact_lp, exact_h = BACKENDS["torch"](hidden.double(), weight.double(), targets)
        grid = (shape["tokens"] // shape["row"], shape["row"])
        for backend in BF16_BACKENDS:
            out = {}
            for dtype in (torch.float32, torch.bfloat16):
                start = time.perf_counter()
                with torch.no_grad():
                    log_probs, entropies = BACKENDS[backend](hidden.to(dtype), weight.to(dtype), targets)
                seconds = time.perf_counter() - start
                log_probs, entropies = log_probs.double(), entropies.double()
                mask, stats = spurious_token_mask(
                    log_probs.view(grid), entropies.view(grid), advantages, torch.ones(grid)
                )
                out[dtype] = (log_probs, entropies, mask, stats, seconds)
            lp32, h32, mask32, stats32, _ = out[torch.float32]
            lp16, h16, mask16, stats16, _ = out[torch.bfloat16]
            max_dh = (h32 - h16).abs().max().item()
            tau_shift = abs(stats32["entropy_threshold"] - stats16["entropy_threshold"])
            disagree = mask32 ^ mask16
            max_dlp = (lp32 - lp16).abs().max().item()
            near_tau_h = (h32.view(grid) - stats32["entropy_threshold"]).abs() <= max_dh + tau_shift
            near_tau_p = (lp32.view(grid) - log_tau_p).abs() <= max_dlp
            run = {
                "seed": seed,
                "backend": backend,
                "max_abs_logit": max_logit,
                "fp32_max_abs_log_p_error_vs_fp64": (lp32 - exact_lp).abs().max().item(),
                "fp32_max_abs_entropy_error_vs_fp64": (h32 - exact_h).abs().max().item(),
                "bf16_max_abs_log_p_error_vs_fp64": (lp16 - exact_lp).abs().max().item(),
                "bf16_max_abs_entropy_error_vs_fp64": (h16 - exact_h).abs().max().item(),
                "max_abs_log_p_difference": max_dlp,
                "max_abs_entropy_difference": max_dh,
                "log_p_crossing_tau_p": int(((lp32 < log_tau_p) ^ (lp16 < log_tau_p)).sum()),
                "candidates_fp32": stats32["num_candidates"],
                "candidates_bf16": stats16["num_candidates"],
                "spurious_fp32": stats32["num_spurious"],
                "spurious_bf16": stats16["num_spurious"],
                "symmetric_difference": int(disagree.sum()),
                "disagreements_near_tau_h": int((disagree & near_tau_h).sum()),
                "disagreements_near_neither_threshold": int((disagree & ~near_tau_h & ~near_tau_p).sum()),
                "tau_h_fp32": stats32["entropy_threshold"],
                "tau_h_bf16": stats16["entropy_threshold"],
                "bf16_entropy_dtype_is_rounded": bool((h16.float().bfloat16().float() == h16.float()).all()),
                "seconds_fp32": out[torch.float32][4],
                "seconds_bf16": out[torch.bfloat16][4],
            }
            runs.append(run)
            print(
                f"seed {seed} {backend:5s} max|dlogp| {run['max_abs_log_p_difference']:.4f} "
                f"max|dH| {max_dh:.4f} spurious {run['spurious_fp32']}/{run['spurious_bf16']} "
                f"symdiff {run['symmetric_difference']} (near tau_h {run['disagreements_near_tau_h']}, "
                f"near neither {run['disagreements_near_neither_threshold']}) "
                f"tau_h {run['tau_h_fp32']:.4f}/{run['tau_h_bf16']:.4f} "
                f"bf16-rounded H {run['bf16_entropy_dtype_is_rounded']}",
                flush=True,
            )
    return runs


def measure_memory(method: str, tokens: int, hidden_size: int, vocab: int) -> dict:
    import torch

    from stapo_trl.core.token_stats.backends import BACKENDS

    function, generator = BACKENDS[method], torch.Generator().manual_seed(0)

    def inputs(n):
        hidden = torch.randn(n, hidden_size, generator=generator).requires_grad_()
        weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).requires_grad_()
        return hidden, weight, torch.randint(0, vocab, (n,), generator=generator)

    hidden, weight, targets = inputs(8)
    log_probs, entropies = function(hidden, weight, targets)
    (log_probs.sum() + entropies.sum()).backward()
    hidden, weight, targets = inputs(tokens)
    before = reset_peak_rss()
    start = time.perf_counter()
    log_probs, entropies = function(hidden, weight, targets)
    (log_probs.sum() + 0.1 * entropies.sum()).backward()
    seconds = time.perf_counter() - start
    finite = bool(torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all())
    return {"seconds": seconds, "peak_mib": peak_growth_mib(before), "finite": finite}


def memory_sweep() -> list[dict]:
    runs = []
    for shape in MEMORY_SHAPES:
        for method, tokens in MEMORY_RUNS:
            command = [sys.executable, __file__, "--worker", method, str(tokens)]
            command += [str(shape["hidden"]), str(shape["vocab"])]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            run = {**shape, "method": method, "tokens": tokens, **json.loads(output.strip().splitlines()[-1])}
            run["one_logits_tensor_mib"] = tokens * shape["vocab"] * 4 / 2**20
            runs.append(run)
            print(
                f"H={shape['hidden']} V={shape['vocab']} {method:5s} N={tokens:6d} {run['seconds']:7.2f} s "
                f"peak {run['peak_mib']:8.1f} MiB  one [N, V] fp32 = {run['one_logits_tensor_mib']:8.0f} MiB",
                flush=True,
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--seeds", type=int, default=3, help="LLM-like batches for the bf16 comparison")
    parser.add_argument("--worker", nargs=4, metavar=("METHOD", "TOKENS", "HIDDEN", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, tokens, hidden, vocab = args.worker
        print(json.dumps(measure_memory(method, int(tokens), int(hidden), int(vocab))))
        return

    import torch

    results = {
        "provenance": provenance(),
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "degenerate_rows": degenerate_rows(),
        "bf16": {"shape": BF16_SHAPE, "runs": bf16_against_fp32(args.seeds)},
        "memory": memory_sweep(),
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
