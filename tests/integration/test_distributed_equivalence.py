"""Two processes (torchrun, gloo) against one process over the same global batch and seed.

`replay_worker.py` replays the same completions in both launches, so the rest of the step (advantages gathered over
processes, the token rules, the loss, the optimizer step) must agree: masks and STARE weights row by row, tau_h and the
other rule statistics, the kept-token counts, the logged loss and the parameters after each optimizer step. The figures
in docs/records/two-processes-against-one.md come from these runs.
"""

import json
import math

import pytest
import torch
from replay_worker import launch, rows_by_identity

from stapo_trl.core.token_rules.stare import stare_token_weights

pytestmark = pytest.mark.distributed

POOLED_CASES = ["s2t:dapo:2", "s2t:grpo:2", "s2t:dapo:1", "stare_optimizer_step:dapo:2"]
MICRO_BATCH_CASE = "stare_micro_batch:dapo:2"
STATISTIC_TOLERANCE = {"rel": 1e-5, "abs": 1e-6}
PARAMETER_TOLERANCE = 1e-5
TRL_METRICS_AVERAGED_PER_PROCESS = {"entropy", "step_time", "train_runtime", "train_samples_per_second"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    single_dir, multi_dir = tmp_path_factory.mktemp("one_process"), tmp_path_factory.mktemp("two_processes")
    cases = [*POOLED_CASES, MICRO_BATCH_CASE]
    return {
        "single": launch(single_dir, 1, cases),
        "multi": launch(multi_dir, 2, cases),
        "dirs": (single_dir, multi_dir),
    }


def steps(launches, case):
    return range(len(launches["single"][case][0]["records"]))


@pytest.mark.parametrize("case", [*POOLED_CASES, MICRO_BATCH_CASE])
def test_both_launches_train_on_the_same_sixteen_completions_per_step(launches, case):
    single, multi = launches["single"][case], launches["multi"][case]
    assert [rank["world_size"] for rank in multi] == [2, 2] and single[0]["world_size"] == 1
    assert len(single[0]["records"]) == len(multi[0]["records"]) == 2
    for step in steps(launches, case):
        single_rows, multi_rows = rows_by_identity(single, step), rows_by_identity(multi, step)
        assert len(single_rows) == 16
        assert single_rows.keys() == multi_rows.keys()


@pytest.mark.parametrize("case", POOLED_CASES)
def test_masks_and_weights_match_row_by_row(launches, case):
    single, multi = launches["single"][case], launches["multi"][case]
    silenced_or_weighted = 0
    for step in steps(launches, case):
        single_rows, multi_rows = rows_by_identity(single, step), rows_by_identity(multi, step)
        for key, expected in single_rows.items():
            actual = multi_rows[key]
            assert torch.equal(actual["silenced"], expected["silenced"]), key
            assert (actual["weights"] is None) == (expected["weights"] is None)
            if expected["weights"] is not None:
                torch.testing.assert_close(actual["weights"], expected["weights"], rtol=0, atol=1e-6)
                silenced_or_weighted += int((expected["weights"] != 1).sum())
            silenced_or_weighted += int(expected["silenced"].sum())
    assert silenced_or_weighted > 0, "the case must exercise the rule"


@pytest.mark.parametrize("case", POOLED_CASES)
def test_rule_statistics_tau_h_and_kept_token_counts_match(launches, case):
    single, multi = launches["single"][case], launches["multi"][case]
    for step in steps(launches, case):
        expected = single[0]["records"][step]
        for rank in multi:
            actual = rank["records"][step]
            assert actual["stats"].keys() == expected["stats"].keys()
            for rule, rule_stats in expected["stats"].items():
                for key, value in rule_stats.items():
                    assert actual["stats"][rule][key] == pytest.approx(value, **STATISTIC_TOLERANCE), (rule, key)
            assert set(actual["num_items_in_batch"]) == set(expected["num_items_in_batch"])
            assert len(set(actual["num_items_in_batch"])) == 1
    if case.startswith("s2t"):
        thresholds = [
            single[0]["records"][step]["stats"]["s2t"]["entropy_threshold"] for step in steps(launches, case)
        ]
        assert not any(math.isnan(threshold) for threshold in thresholds), "tau_h must be defined: candidates exist"


@pytest.mark.parametrize("case", POOLED_CASES)
def test_logged_loss_and_metrics_match(launches, case):
    single, multi = launches["single"][case][0]["log_history"], launches["multi"][case][0]["log_history"]
    assert len(single) == len(multi) == 3
    for expected, actual in zip(single, multi, strict=True):
        assert actual.keys() == expected.keys()
        for key, value in expected.items():
            if key not in TRL_METRICS_AVERAGED_PER_PROCESS and not key.endswith("_per_second"):
                assert actual[key] == pytest.approx(value, **STATISTIC_TOLERANCE), key
    assert "loss" in single[0] and single[0]["loss"] != 0


@pytest.mark.parametrize("case", POOLED_CASES)
def test_parameters_after_each_optimizer_step_match(launches, case):
    single, multi = launches["single"][case][0]["parameters"], [rank["parameters"] for rank in launches["multi"][case]]
    assert len(single) == 3, "the initial parameters and those after each of the two steps"
    for snapshot, expected in enumerate(single):
        for name, value in expected.items():
            assert torch.equal(multi[0][snapshot][name], multi[1][snapshot][name]), "replicas must stay identical"
            assert (multi[0][snapshot][name] - value).abs().max() <= PARAMETER_TOLERANCE, (snapshot, name)
    first_step_change = max((value - single[0][name]).abs().max().item() for name, value in single[1].items())
    assert first_step_change > 100 * PARAMETER_TOLERANCE, "the step must move the parameters far beyond the tolerance"


def test_micro_batch_stare_selects_within_each_micro_batch_of_each_process(launches):
    multi = launches["multi"][MICRO_BATCH_CASE]
    weighted = 0
    for rank in multi:
        for record in rank["records"]:
            stats = record["stats"]["stare"]
            sizes = record["micro_batch_rows"]
            groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
            expected = stare_token_weights(
                record["log_probs"],
                record["advantages"],
                record["loss_mask"],
                variant="C2",
                top_surprisal_share=0.2,
                positive_weight=record["weights"].max().item(),
                negative_weight=record["weights"].min().item(),
                gate_on=bool(stats["gate_on"]),
                groups=groups,
                across_processes=False,
                reduce_statistics=False,
            )
            torch.testing.assert_close(record["weights"], expected.weights, rtol=0, atol=1e-6)
            weighted += int((record["weights"] != 1).sum())
    assert weighted > 0


def dumped_records(directory):
    with open(directory / "silenced_tokens.jsonl") as file:
        return [json.loads(line) for line in file]


@pytest.mark.parametrize("case", [case for case in POOLED_CASES if case.startswith("s2t")])
def test_the_dump_samples_across_processes_without_duplicates_or_strays(launches, case):
    single_dir, multi_dir = (directory / case.replace(":", "-") for directory in launches["dirs"])
    multi = launches["multi"][case]
    with open(single_dir / "silenced_tokens_stats.json") as file:
        single_stats = json.load(file)
    with open(multi_dir / "silenced_tokens_stats.json") as file:
        multi_stats = json.load(file)
    assert multi_stats["steps"] == single_stats["steps"]
    assert multi_stats["density"] == single_stats["density"]

    records = dumped_records(multi_dir)
    assert len({(record["sample_id"], record["position"]) for record in records}) == len(records)
    processes = set()
    for step_counts in multi_stats["steps"]:
        step_records = [record for record in records if record["step"] == step_counts["step"]]
        assert len(step_records) == step_counts["written"] == min(5, step_counts["silenced"])
        for record in step_records:
            _, process, row = (int(part) for part in record["sample_id"].split("-"))
            processes.add(process)
            step_record = multi[process]["records"][record["step"] - 1]
            assert step_record["silenced"][row, record["position"]]
            assert step_record["completion_ids"][row][record["position"]] == record["token_id"]
    assert processes == {0, 1}, "the sample is drawn over both processes' silenced tokens"
