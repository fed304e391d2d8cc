"""How far 2 processes (torchrun, gloo) are from 1 on the same global batch: the figures behind
docs/records/two-processes-against-one.md.

Launches tests/integration/replay_worker.py both ways (the runs tests/integration/test_distributed_equivalence.py
asserts on) and reports, per case, the largest differences over both optimizer steps: rows whose S2T mask differs,
STARE weights, rule statistics (tau_h included), the logged loss (absolute: it can be ~0), and the parameters after
each step.

    python benchmarks/bench_distributed_equivalence.py --out docs/benchmarks/distributed_equivalence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from replay_worker import launch, rows_by_identity  # noqa: E402

CASES = ["s2t:dapo:2", "s2t:grpo:2", "s2t:dapo:1", "stare_optimizer_step:dapo:2"]


def relative(a: float, b: float) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    return abs(a - b) / max(abs(b), 1e-12)


def compare(single: list[dict], multi: list[dict]) -> dict[str, float | int]:
    figures = {"tokens": 0, "silenced": 0, "weighted": 0, "mask_rows_differing": 0, "max_abs_weight_diff": 0.0}
    figures |= {"max_rel_stat_diff": 0.0, "max_abs_loss_diff": 0.0, "max_abs_param_diff": 0.0}
    for step in range(len(single[0]["records"])):
        one, two = rows_by_identity(single, step), rows_by_identity(multi, step)
        for key, row in one.items():
            silenced, weights = row["silenced"], row["weights"]
            other_silenced, other_weights = two[key]["silenced"], two[key]["weights"]
            figures["tokens"] += silenced.numel()
            figures["silenced"] += int(silenced.sum())
            figures["mask_rows_differing"] += int(not torch.equal(silenced, other_silenced))
            if weights is not None:
                figures["weighted"] += int((weights != 1).sum())
                difference = (weights - other_weights).abs().max().item()
                figures["max_abs_weight_diff"] = max(figures["max_abs_weight_diff"], difference)
        for rule, stats in single[0]["records"][step]["stats"].items():
            for key, value in stats.items():
                for rank in multi:
                    difference = relative(rank["records"][step]["stats"][rule][key], value)
                    figures["max_rel_stat_diff"] = max(figures["max_rel_stat_diff"], difference)
    for expected, actual in zip(single[0]["log_history"], multi[0]["log_history"], strict=True):
        if "loss" in expected:
            figures["max_abs_loss_diff"] = max(figures["max_abs_loss_diff"], abs(actual["loss"] - expected["loss"]))
    for expected, actual in zip(single[0]["parameters"], multi[0]["parameters"], strict=True):
        for name, value in expected.items():
            difference = (actual[name] - value).abs().max().item()
            figures["max_abs_param_diff"] = max(figures["max_abs_param_diff"], difference)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        single = launch(Path(directory) / "one", 1, CASES)
        multi = launch(Path(directory) / "two", 2, CASES)
    results = {case: compare(single[case], multi[case]) for case in CASES}
    print(
        "| case (rule:loss:GA) | tokens | silenced | weighted | mask rows differing | max abs weight diff "
        "| max rel stat diff | max abs loss diff | max abs param diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case, figures in results.items():
        print(
            f"| {case} | {figures['tokens']} | {figures['silenced']} | {figures['weighted']} | "
            f"{figures['mask_rows_differing']} | "
            f"{figures['max_abs_weight_diff']:.1e} | {figures['max_rel_stat_diff']:.1e} | "
            f"{figures['max_abs_loss_diff']:.1e} | {figures['max_abs_param_diff']:.1e} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"provenance": provenance(), "torch": torch.__version__, "cases": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
