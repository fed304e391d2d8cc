"""Cost of the rewards on one GRPO generation batch, and the math_verify worker against TRL's in-process verifier.

The batch is 512 completions (64 prompts x 8, the paper's optimizer mini-batch) of about 2,000 characters each,
built from the shipped DAPO sample: a mix of right and wrong boxed answers, equivalent forms, `Answer:` lines and
no answer at all.

    python benchmarks/bench_rewards.py --out docs/benchmarks/rewards.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor

from provenance import provenance

BATCH = 512
REASONING = "We set up the quantities carefully and simplify step by step, checking each line. " * 24


def build_batch(seed: int = 0) -> tuple[list[str], list[str]]:
    from stapo_trl.data import load_dapo_math

    golds = load_dapo_math("sample")["answer"]
    rng = random.Random(seed)
    completions, solutions = [], []
    for index in range(BATCH):
        gold = golds[index % len(golds)]
        kind = rng.choice(["boxed", "boxed_wrong", "answer_line", "frac_form", "none"])
        if kind == "boxed":
            ending = f"So the final answer is $\\boxed{{{gold}}}$."
        elif kind == "boxed_wrong":
            ending = f"So the final answer is $\\boxed{{{int(gold) + 1}}}$."
        elif kind == "answer_line":
            ending = f"Answer: {gold}"
        elif kind == "frac_form":
            ending = f"So the final answer is $\\boxed{{\\dfrac{{{2 * int(gold)}}}{{2}}}}$."
        else:
            ending = "I could not finish in time."
        completions.append(REASONING + ending)
        solutions.append(gold)
    return completions, solutions


def timed(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from trl.rewards import accuracy_reward

    from stapo_trl.rewards import MathVerifyReward, boxed_reward, dapo_reward

    completions, solutions = build_batch()
    conversational = [[{"role": "assistant", "content": text}] for text in completions]
    results: dict = {"batch": BATCH, "mean_chars": sum(map(len, completions)) / BATCH}

    results["dapo_s"] = timed(lambda: dapo_reward(completions, solution=solutions))
    results["boxed_s"] = timed(lambda: boxed_reward(completions, solution=solutions))

    reward = MathVerifyReward()
    start = time.perf_counter()
    reward(completions[:1], solution=solutions[:1])
    results["math_verify_worker_start_s"] = time.perf_counter() - start
    results["math_verify_main_thread_s"] = timed(lambda: reward(completions, solution=solutions))

    def in_threads():
        chunks = [(completions[i : i + 128], solutions[i : i + 128]) for i in range(0, BATCH, 128)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            return [s for part in pool.map(lambda c: reward(c[0], solution=c[1]), chunks) for s in part]

    in_threads()
    results["math_verify_4_threads_s"] = timed(in_threads)
    results["trl_accuracy_reward_main_thread_s"] = timed(lambda: accuracy_reward(conversational, solution=solutions))

    ours = reward(completions, solution=solutions)
    theirs = accuracy_reward(conversational, solution=solutions)
    results["agreement_with_trl"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / BATCH
    results["math_verify_mean_score"] = sum(ours) / BATCH
    results["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    results = {"provenance": provenance(), **results}
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
