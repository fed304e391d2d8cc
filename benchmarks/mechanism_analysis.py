"""The pre-registered analysis of the mechanism study at learning rate 2e-3 with nine seeds (issue 37).

Written and committed before the runs it reads (seeds 3 to 8, and the tau_p dose arm) were started; the plan it
implements is docs/records/mechanism-power-2e-3.md. It reads the results that `bench_mechanism.py study` writes:

    python benchmarks/mechanism_analysis.py \\
        --calibration docs/benchmarks/mechanism_study_2e-3.json \\
        --power docs/benchmarks/mechanism_power_2e-3.json \\
        --dose docs/benchmarks/mechanism_dose_2e-3.json

and writes docs/benchmarks/mechanism_analysis.json. Files that do not exist yet are left out, and what cannot be
computed without them is reported as missing, so the script runs at any point of the study.

- **Primary outcome**: the held-out greedy accuracy after training, STAPO minus GRPO (with S2T in shadow), paired by
  seed, over seeds 0 to 8 (0 to 2 from the study of 2026-11-26, 3 to 8 new): the mean difference and its 95%
  t-interval.
- **Secondary outcomes** (no decision rests on them): the per-problem sign test pooled over seeds; gradient spikes
  against a threshold calibrated on the existing GRPO runs; entropy below 0.3 nats; RANDOM minus GRPO; the probe's
  ratios of S2T's gradient share over the count-matched baselines; the dose-response over tau_p.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from provenance import REPO, provenance

T_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
}
"""The 0.975 quantile of Student's t with ``df`` degrees of freedom (standard tables, three decimals)."""

ENTROPY_FLOOR = 0.3
DEFAULT_PROB_THRESHOLD = 0.002


def spike_threshold(calibration_runs: list[dict]) -> float:
    """The largest ratio of the largest to the median gradient norm over the GRPO runs of the calibration study: a
    run of another seed 'spikes' when its ratio exceeds every one that ordinary GRPO learning produced there."""
    ratios = [
        run["grad_norm_max"] / run["grad_norm_median"]
        for run in calibration_runs
        if run["run"].startswith("grpo-") and run.get("grad_norm_median")
    ]
    return max(ratios)


def seed_of(run: dict) -> int:
    return int(run["run"].rsplit("seed", 1)[1])


def arm_of(run: dict) -> str:
    return run["run"].split("-", 1)[0]


def prob_threshold_of(run: dict) -> float:
    for part in run["run"].split("-"):
        if part.startswith("tp"):
            return float(part[2:])
    return DEFAULT_PROB_THRESHOLD


def mean_interval(values: list[float]) -> dict:
    """Mean, standard deviation and 95% t-interval of paired differences."""
    n = len(values)
    if n < 2:
        return {"n": n, "mean": values[0] if values else None, "sd": None, "ci95": None}
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = T_975[n - 1] * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def sign_test(first: int, second: int) -> float | None:
    """Two-sided exact binomial test of ``first`` against ``second`` discordant outcomes at p = 1/2."""
    n = first + second
    if n == 0:
        return None
    tail = sum(math.comb(n, k) for k in range(min(first, second) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_differences(runs: list[dict], arm: str, against: str = "grpo") -> dict[int, float]:
    by_key = {(arm_of(run), seed_of(run)): run for run in runs if run.get("finished")}
    return {
        seed: by_key[(arm, seed)]["accuracy_after"] - by_key[(against, seed)]["accuracy_after"]
        for (name, seed) in sorted(by_key)
        if name == arm and (against, seed) in by_key
    }


def reading_of_primary(interval: dict) -> str:
    if interval["ci95"] is None:
        return "not enough seeds for an interval"
    low, high = interval["ci95"]
    if high < 0:
        return "STAPO's held-out accuracy is below GRPO's on this task (the interval excludes 0)"
    if low > 0:
        return "STAPO's held-out accuracy is above GRPO's on this task (the interval excludes 0)"
    return "no difference detected: the interval contains 0, and its ends bound the effect"


def probe_ratios(runs: list[dict]) -> dict:
    """Per probed step with silenced tokens, S2T's grad share per token share over each baseline's, pooled over the
    given runs, overall and split into the first optimizer step after a generation and the later ones."""
    result = {}
    for baseline in ("random_positive", "random_candidate"):
        key = f"silenced_share_over_{baseline}"
        split = {"all": [], "first_after_generation": [], "later": []}
        for run in runs:
            probe = run.get("probe", {})
            for ratio, since in zip(probe.get(key, []), probe.get("steps_since_generation", []), strict=False):
                if ratio is None or not ratio > 0:
                    continue
                split["all"].append(ratio)
                split["first_after_generation" if since == 0 else "later"].append(ratio)
        result[baseline] = {name: ratio_summary(values) for name, values in split.items()}
    return result


def ratio_summary(ratios: list[float]) -> dict:
    """The ratios' median and geometric mean, and the sign test two ways: steps above 1 against all others (as the
    plan was first computed), and above against below with the ties dropped. A tie, a ratio of exactly 1, is a step
    whose baseline drew S2T's own set: it carries no information on which set carries more."""
    if not ratios:
        return {"steps": 0}
    above = sum(ratio > 1 for ratio in ratios)
    below = sum(ratio < 1 for ratio in ratios)
    return {
        "steps": len(ratios),
        "median": statistics.median(ratios),
        "geometric_mean": math.exp(statistics.fmean(math.log(ratio) for ratio in ratios)),
        "steps_above_1": above,
        "steps_below_1": below,
        "ties": len(ratios) - above - below,
        "sign_test_p": sign_test(above, len(ratios) - above),
        "sign_test_p_ties_dropped": sign_test(above, below),
    }


def count_events(runs: list[dict], threshold: float) -> dict:
    events = {}
    for run in runs:
        if not run.get("grad_norm_median"):
            continue
        arm = arm_of(run)
        counts = events.setdefault(arm, {"runs": 0, "spikes": 0, "entropy_below_floor": 0})
        counts["runs"] += 1
        counts["spikes"] += run["grad_norm_max"] / run["grad_norm_median"] > threshold
        counts["entropy_below_floor"] += run["entropy_min"] is not None and run["entropy_min"] < ENTROPY_FLOOR
    return events


def silenced_tokens(run: dict) -> float | None:
    return run.get("s2t/num_silenced")


def dose_response(calibration_runs: list[dict], dose_runs: list[dict]) -> list[dict]:
    """STAPO at each tau_p against GRPO of the same seed (GRPO from the calibration study)."""
    grpo = {seed_of(run): run for run in calibration_runs if arm_of(run) == "grpo" and run.get("finished")}
    stapo = [run for run in calibration_runs + dose_runs if arm_of(run) == "stapo" and run.get("finished")]
    rows = []
    for threshold in sorted({prob_threshold_of(run) for run in stapo}, reverse=True):
        at = [run for run in stapo if prob_threshold_of(run) == threshold and seed_of(run) in grpo]
        differences = [run["accuracy_after"] - grpo[seed_of(run)]["accuracy_after"] for run in at]
        silenced = [silenced_tokens(run) for run in at]
        fractions = [run.get("s2t_silenced_fraction_mean") for run in at]
        rows.append(
            {
                "prob_threshold": threshold,
                "seeds": [seed_of(run) for run in at],
                "difference_from_grpo": differences,
                "difference_mean": statistics.fmean(differences) if differences else None,
                "silenced_tokens": silenced,
                "silenced_tokens_mean": statistics.fmean(silenced) if None not in silenced and silenced else None,
                "silenced_fraction_mean": fractions if None not in fractions else None,
            }
        )
    return rows


def reading_of_dose(rows: list[dict]) -> str:
    """What the dose rows show, and no more: whether the mean deficit orders with the mean number of silenced tokens.
    A run that silenced a single token can end as far from GRPO as one that silenced dozens (seed 0 at 2e-4: one
    token, the same deficit as 43 tokens at 0.002), so an ordering of means over a few seeds measures how far runs
    drift apart after a perturbation, not how much learning signal the mask removes."""
    usable = [row for row in rows if row["difference_mean"] is not None and row["silenced_tokens_mean"] is not None]
    if len(usable) < 2:
        return "fewer than two thresholds finished"
    by_dose = sorted(usable, key=lambda row: row["silenced_tokens_mean"])
    deficits = [-row["difference_mean"] for row in by_dose]
    ordered = all(later > earlier for earlier, later in zip(deficits, deficits[1:], strict=False))
    fewest = min(
        (count, seed) for row in usable for count, seed in zip(row["silenced_tokens"], row["seeds"], strict=True)
    )
    return (
        f"the mean deficit {'grows' if ordered else 'does not grow'} with the mean number of silenced tokens "
        f"({len(usable[0]['seeds'])} seeds per threshold); a description, not a test: the run that silenced fewest "
        f"tokens (seed {fewest[1]}, {fewest[0]:g} token(s)) shows how far one perturbation moves a run"
    )


def load_runs(path: Path | None) -> tuple[list[dict], dict]:
    if path is None or not path.is_file():
        return [], {}
    record = json.loads(path.read_text())
    return record["runs"], record.get("paired", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmarks = REPO / "docs" / "benchmarks"
    parser.add_argument("--calibration", type=Path, default=benchmarks / "mechanism_study_2e-3.json")
    parser.add_argument("--power", type=Path, default=benchmarks / "mechanism_power_2e-3.json")
    parser.add_argument("--dose", type=Path, default=benchmarks / "mechanism_dose_2e-3.json")
    parser.add_argument("--output", type=Path, default=benchmarks / "mechanism_analysis.json")
    args = parser.parse_args()

    calibration, calibration_paired = load_runs(args.calibration)
    power, power_paired = load_runs(args.power)
    dose, _ = load_runs(args.dose)
    threshold = spike_threshold(calibration)

    differences = {**paired_differences(calibration, "stapo"), **paired_differences(power, "stapo")}
    primary = mean_interval([differences[seed] for seed in sorted(differences)])
    primary["per_seed"] = {str(seed): differences[seed] for seed in sorted(differences)}
    primary["reading"] = reading_of_primary(primary)

    pooled = {}
    for pair, (first, second) in {"stapo_vs_grpo": ("stapo", "grpo"), "random_vs_grpo": ("random", "grpo")}.items():
        counts = {
            key: calibration_paired.get(pair, {}).get(key, 0) + power_paired.get(pair, {}).get(key, 0)
            for key in (f"only_{first}", f"only_{second}", "both", "neither")
        }
        counts["sign_test_p"] = sign_test(counts[f"only_{first}"], counts[f"only_{second}"])
        pooled[pair] = counts

    random_differences = {**paired_differences(calibration, "random"), **paired_differences(power, "random")}
    random_interval = mean_interval([random_differences[seed] for seed in sorted(random_differences)])
    random_interval["per_seed"] = {str(seed): random_differences[seed] for seed in sorted(random_differences)}

    dose_rows = dose_response(calibration, dose)
    analysis = {
        "provenance": provenance(),
        "plan": "docs/records/mechanism-power-2e-3.md",
        "primary": {"outcome": "held-out accuracy after training, STAPO minus GRPO, paired by seed", **primary},
        "secondary": {
            "per_problem_sign_test_pooled": pooled,
            "spike_threshold": threshold,
            "events_on_new_seeds": count_events(power, threshold),
            "random_minus_grpo": random_interval,
            "probe_grpo_shadow": probe_ratios([run for run in power if arm_of(run) == "grpo"]),
            "probe_stapo": probe_ratios([run for run in power if arm_of(run) == "stapo"]),
            "dose_response": dose_rows,
            "dose_reading": reading_of_dose(dose_rows),
        },
    }
    args.output.write_text(json.dumps(analysis, indent=2) + "\n")
    print(f"primary: {primary['n']} seeds, mean {primary['mean']}, 95% CI {primary['ci95']}: {primary['reading']}")
    print(f"spike threshold (max/median grad norm): {threshold:.4f}")
    print(f"dose: {analysis['secondary']['dose_reading']}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
