"""The GPU check (`benchmarks/gpu_check.py`, issue 35) in its CPU mode, so that it cannot rot before a GPU runs it: the
whole check end to end at toy sizes, through the code paths of the CUDA run except its kernels, and the parts that
decide pass or fail, fed figures that must fail."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SECTIONS = ["setup", "kernels", "equivalence", "mask", "cost-toy-2-layer"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.log").read_text()


def measurements(data: dict, section: str) -> dict[str, dict]:
    (found,) = [s for s in data["sections"] if s["name"] == section]
    return {m["name"]: m for m in found["measurements"]}


@pytest.mark.slow
def test_every_section_runs_and_passes_on_the_cpu(cpu_run):
    data, log = cpu_run
    assert data["device_mode"] == "cpu" and data["complete"] is True
    assert [s["name"] for s in data["sections"]] == SECTIONS
    assert {s["name"]: s["status"] for s in data["sections"]} == dict.fromkeys(SECTIONS, "passed")
    assert {"date", "commit", "packages", "cpu"} <= set(data["provenance"])
    assert data["summary"]["fail"] == 0 and data["summary"]["pass"] >= 25
    for section in data["sections"]:
        for measurement in section["measurements"]:
            assert {"name", "value", "unit", "target", "status"} <= set(measurement)
            if measurement["status"] in ("pass", "fail"):
                assert measurement["target"], measurement["name"]
            assert f"] {measurement['name']}: " in log, measurement["name"]


@pytest.mark.slow
def test_the_kernels_are_within_tolerance_and_memory_is_not_claimed_on_the_cpu(cpu_run):
    kernels = measurements(cpu_run[0], "kernels")
    for kernel in ("trl_fused", "liger", "liger_fallback_forced", "ours"):
        for quantity in ("log p max error vs fp64", "H max error vs fp64"):
            assert kernels[f"{kernel} {quantity}"]["status"] == "pass"
        for quantity in ("grad hidden relative error vs fp64", "grad weight relative error vs fp64"):
            assert kernels[f"{kernel} {quantity}"]["status"] == "pass"
        for phase in ("forward", "forward+backward"):
            memory = kernels[f"{kernel} {phase} peak memory"]
            assert memory["status"] == "not_measured" and memory["value"] is None


@pytest.mark.slow
def test_stapo_is_bit_identical_to_grpo_when_it_silences_nothing(cpu_run):
    equivalence = measurements(cpu_run[0], "equivalence")
    assert equivalence["share of weights the GRPO steps changed"]["value"] > 0.5
    for label in ("stapo_mask_off", "stapo_nothing_silenced"):
        for quantity in ("parameter", "logged"):
            figure = equivalence[f"{label} against GRPO: largest {quantity} difference"]
            assert (figure["value"], figure["target"], figure["status"]) == (0, "0 (bit-identical)", "pass")


@pytest.mark.slow
def test_the_trainers_mask_is_spurious_token_mask_on_the_same_tensors_and_fires(cpu_run):
    mask = measurements(cpu_run[0], "mask")
    differing = mask["silenced tokens that differ from spurious_token_mask on the same p, H, A"]
    assert (differing["value"], differing["status"]) == (0, "pass")
    fired = mask["tokens silenced at prob_threshold 0.002, entropy_quantile 0.8"]
    assert fired["value"] > 0 and fired["status"] == "pass"


@pytest.mark.slow
def test_the_cost_ratio_is_measured_but_its_target_is_not_claimed_on_the_cpu(cpu_run):
    cost = measurements(cpu_run[0], "cost-toy-2-layer")
    ratio = cost["STAPO/GRPO time per optimizer step"]
    assert ratio["status"] == "not_applicable" and math.isfinite(ratio["value"]) and ratio["value"] > 0
    assert cost["STAPO/GRPO peak GPU memory"]["status"] == "not_measured"


# ---------------------------------------------------------------- the parts that decide, without a run
@pytest.fixture(scope="module")
def gpu_modules():
    saved_path = list(sys.path)  # restored whole: whatever the imports add would reach later tests' processes
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
        from gpu import equivalence, kernels

        yield gpu_check, kernels, equivalence
    finally:
        sys.path[:] = saved_path


@pytest.fixture(scope="module")
def toy_kernel(gpu_modules):
    """Inputs of the kernels section at toy size, and their fp64 reference."""
    _, kernels, _ = gpu_modules
    inputs = kernels.make_inputs(256, 32, 500, "cpu")
    return inputs, kernels.fp64_reference(inputs, rows=64)


class RecordingSection:
    """Stands in for `gpu_check.Section`: keeps what is recorded."""

    on_cuda = False

    def __init__(self):
        self.records = {}

    def record(self, name, value, unit, target, passed, note="", status=None):
        self.records[name] = status or ("info" if passed is None else "pass" if passed else "fail")


def test_a_kernel_off_by_a_temperature_or_a_vocabulary_chunk_fails_the_fp64_tolerance(gpu_modules, toy_kernel):
    _, kernels, _ = gpu_modules
    inputs, reference = toy_kernel
    exact = RecordingSection()
    kernels.check_values(exact, "exact", reference["log_probs"], reference["entropies"], reference)
    assert set(exact.records.values()) == {"pass"}
    logits = inputs["hidden"].double() @ inputs["weight"].double().t()
    targets = inputs["targets"]
    hot = RecordingSection()
    kernels.check_values(hot, "hot", *kernels._exact_statistics(logits / 1.1, targets), reference)
    assert set(hot.records.values()) == {"fail"}
    partial = RecordingSection()  # the softmax of the first 400 of 500 entries, the target's logit still right
    truncated = torch.log_softmax(logits[:, :400], dim=-1)
    log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits[:, :400], dim=-1)
    entropies = -(truncated.exp() * truncated).sum(-1)
    kernels.check_values(partial, "partial", log_probs, entropies, reference)
    assert set(partial.records.values()) == {"fail"}


def test_a_gradient_with_a_missing_term_fails_its_tolerance(gpu_modules, toy_kernel):
    _, kernels, _ = gpu_modules
    _, reference = toy_kernel
    section = RecordingSection()
    kernels.check_gradients(section, "exact", reference["grad_hidden"], reference["grad_weight"], reference)
    assert set(section.records.values()) == {"pass"}
    kernels.check_gradients(section, "halved", reference["grad_hidden"] / 2, reference["grad_weight"] * 0, reference)
    assert section.records["halved grad hidden relative error vs fp64"] == "fail"
    assert section.records["halved grad weight relative error vs fp64"] == "fail"


def test_one_differing_parameter_or_logged_number_is_found(gpu_modules):
    _, _, equivalence = gpu_modules
    first = {"w": torch.zeros(3, dtype=torch.bfloat16), "b": torch.ones(2)}
    second = {"w": torch.tensor([0.0, 0.0, 2**-10], dtype=torch.bfloat16), "b": torch.ones(2)}
    assert equivalence.parameter_difference(first, second) == (2**-10, ["w"])
    assert equivalence.parameter_difference(first, first) == (0.0, [])
    logs = [{"loss": 0.5, "step_time": 1.0, "entropy": float("nan")}]
    assert equivalence.log_difference(logs, [{"loss": 0.5, "step_time": 9.0, "entropy": float("nan")}]) == (0.0, None)
    assert equivalence.log_difference(logs, [{"loss": 0.25, "step_time": 1.0, "entropy": float("nan")}])[0] == 0.25


def test_a_section_out_of_time_is_recorded_as_incomplete_and_the_next_still_runs(gpu_modules, tmp_path):
    gpu_check, _, _ = gpu_modules
    run_clock = gpu_check.Clock(60)
    report = gpu_check.Report(tmp_path, {"provenance": {}}, run_clock)

    class Plan:
        budgets = {"slow": 0.05, "cost": 10.0}
        minimum_section_s = 0.0

    def slow(section, plan, environment):
        section.record("first figure", 1.0, "s", "<= 2", True)
        time.sleep(0.1)
        section.clock.require(1, "the second figure")

    def quick(section, plan, environment):
        section.skip("a figure", "the reason")

    gpu_check.run_section(report, run_clock, Plan, "cpu", "slow", slow, {})
    gpu_check.run_section(report, run_clock, Plan, "cpu", "quick", quick, {})
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["status"]) for s in data["sections"]] == [("slow", "incomplete"), ("quick", "incomplete")]
    assert "the second figure needs about 1 s" in data["sections"][0]["reason"]
    assert data["sections"][0]["measurements"][0]["status"] == "pass"
    assert data["sections"][1]["measurements"][0] == {
        "name": "a figure",
        "value": None,
        "unit": "",
        "target": "",
        "status": "skipped",
        "note": "the reason",
    }
