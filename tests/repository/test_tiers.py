"""The tiers and the time budget of tests/tiers.py, run on a dummy suite in a pytest of its own: a test over the
budget fails and is named, children's CPU time counts, the slow tier is exempt, and the markers that imply ``slow``
move a test out of the default tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
BUDGET_S = 0.4
"""Small, so that the dummy's busy tests exceed it by twice its size while the suite's own test stays cheap."""
BUSY_S = 2.5 * BUDGET_S

DUMMY_SUITE = f"""
import subprocess, sys, time
import pytest

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_fast():
    burn(0.01)

def test_busy():
    burn({BUSY_S})

def test_busy_in_a_child_process():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + {BUSY_S}\\n"
                    "while time.process_time() < end: pass"], check=True)

def test_asleep():
    time.sleep({BUSY_S})

@pytest.mark.slow
def test_busy_but_slow():
    burn({BUSY_S})

@pytest.mark.distributed
def test_distributed_is_slow_too():
    burn(0.01)

def test_busy_and_failing():
    burn({BUSY_S})
    assert False, "its own failure"
"""


def run_dummy_suite(tmp_path: Path, *args: str, **environment: str) -> tuple[subprocess.CompletedProcess, list]:
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -p no:cacheprovider -m 'not slow'\nmarkers =\n    slow\n    distributed\n"
    )
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from tiers import Tiers

        def pytest_configure(config):
            config.pluginmanager.register(Tiers(), "stapo-tiers")
        """)
    )
    (tmp_path / "test_dummy.py").write_text(DUMMY_SUITE)
    times = tmp_path / "times.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("STAPO_TEST_")}
    env.update(STAPO_TEST_TIMES=str(times), **environment)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    return done, json.loads(times.read_text()) if times.exists() else []


def outcomes(times: list) -> dict[str, str]:
    return {entry["nodeid"].split("::")[1]: entry["outcome"] for entry in times}


def test_a_default_tier_test_over_the_cpu_budget_fails_and_is_named(tmp_path):
    done, times = run_dummy_suite(tmp_path, STAPO_TEST_BUDGET_CPU_S=str(BUDGET_S))
    assert done.returncode == 1, done.stdout
    assert outcomes(times) == {
        "test_fast": "passed",
        "test_busy": "failed",
        "test_busy_in_a_child_process": "failed",
        "test_asleep": "passed",
        "test_busy_and_failing": "failed",
    }
    cpu = {entry["nodeid"].split("::")[1]: entry["cpu_s"] for entry in times}
    assert (
        cpu["test_busy"] >= BUSY_S and cpu["test_busy_in_a_child_process"] >= BUSY_S and cpu["test_asleep"] < BUDGET_S
    )
    assert f"over the budget of {BUDGET_S:g} s" in done.stdout
    assert "OVER BUDGET: test_dummy.py::test_busy " in done.stdout
    assert "OVER BUDGET: test_dummy.py::test_busy_in_a_child_process " in done.stdout
    # A test that fails on its own keeps its own failure, and is not counted again as over budget.
    assert "its own failure" in done.stdout and "OVER BUDGET: test_dummy.py::test_busy_and_failing" not in done.stdout
    assert "this run: 5 tests (5 of the default tier)" in done.stdout


def test_the_slow_tier_has_no_budget_and_takes_the_tests_that_launch_processes(tmp_path):
    done, times = run_dummy_suite(tmp_path, "-m", "slow", STAPO_TEST_BUDGET_CPU_S=str(BUDGET_S))
    assert done.returncode == 0, done.stdout
    assert outcomes(times) == {"test_busy_but_slow": "passed", "test_distributed_is_slow_too": "passed"}
    assert "this run: 2 tests (0 of the default tier)" in done.stdout


def test_a_wall_budget_catches_a_test_that_waits(tmp_path):
    done, times = run_dummy_suite(
        tmp_path, "-k", "fast or asleep", STAPO_TEST_BUDGET_CPU_S="30", STAPO_TEST_BUDGET_WALL_S=str(BUDGET_S)
    )
    assert done.returncode == 1, done.stdout
    assert outcomes(times) == {"test_fast": "passed", "test_asleep": "failed"}
    assert f"of wall time, over the budget of {BUDGET_S:g} s" in done.stdout


@pytest.mark.parametrize("value", ["thirty", "0", "-5"])
def test_a_budget_that_is_not_a_positive_number_is_refused(tmp_path, value):
    done, _ = run_dummy_suite(tmp_path, STAPO_TEST_BUDGET_CPU_S=value)
    assert done.returncode == 4
    assert "$STAPO_TEST_BUDGET_CPU_S must be" in done.stderr + done.stdout


def test_this_suite_runs_the_default_tier_under_the_budget(request):
    from tiers import DEFAULT_BUDGET_CPU_S, Tiers

    assert "-m" in request.config.getini("addopts") and "not slow" in request.config.getini("addopts")
    plugin = request.config.pluginmanager.get_plugin("stapo-tiers")
    assert isinstance(plugin, Tiers)
    assert plugin.budget_cpu_s == float(os.environ.get("STAPO_TEST_BUDGET_CPU_S") or DEFAULT_BUDGET_CPU_S)
