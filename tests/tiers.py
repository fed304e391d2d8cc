"""The suite's two tiers and the default tier's time budget: a pytest plugin that `conftest.py` registers for every run.

The default tier is what ``python -m pytest`` runs: pyproject.toml's ``addopts`` leave out the tests marked ``slow``.
The slow tier is ``python -m pytest -m slow``. A test that launches several processes (``distributed``) or DeepSpeed
(``deepspeed``) belongs to the slow tier wherever it is: the plugin gives it the ``slow`` marker before ``-m``
selects.

Each test is timed from the start of its setup to the end of its call, so a fixture's first use (a shared training
run, say) counts against the test that pays for it. Two clocks are read: wall time, and CPU time, which sums the
pytest process's threads and every child process it has waited for (a `subprocess.run`, a `torchrun` launch).

A test of the default tier (one not marked ``slow``, ``distributed``, ``deepspeed`` or ``vllm``) fails when its CPU
time exceeds the budget: `DEFAULT_BUDGET_CPU_S`, or ``$STAPO_TEST_BUDGET_CPU_S``. CPU time rather than wall time,
because the machines that run these tests are shared: on a busy 2-core machine a test's wall time grows with the
load (three to five times its CPU time, measured here under a load average of 9 to 19), while its CPU time moved by
about 10% from run to run, with torch's threads sleeping between parallel regions as `conftest.py` sets them
(spinning threads burn CPU time that grows with the load too). A wall-clock budget would fail tests at random. CPU
time cannot see a test that sleeps or waits; ``$STAPO_TEST_BUDGET_WALL_S`` adds a wall-clock budget for runs on an
idle machine.

At the end of the run the plugin prints the tier's totals and its slowest tests. ``$STAPO_TEST_TIMES=path`` writes
every test's times there as JSON, one object per test, for the measurements in docs/records/.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

DEFAULT_BUDGET_CPU_S = 30.0
IMPLYING_SLOW = ("distributed", "deepspeed")
"""A test with any of these markers gets ``slow`` too."""
OTHER_ENVIRONMENT_MARKERS = ("vllm",)
"""Tests that run in an environment of their own (docs/vllm.md), outside both tiers of the main one."""
SHOWN = 10


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children that have been waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def budget_from_environment(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        budget = float(value)
    except ValueError:
        raise pytest.UsageError(f"${name} must be a number of seconds, got {value!r}") from None
    if budget <= 0:
        raise pytest.UsageError(f"${name} must be positive, got {value!r}")
    return budget


def in_default_tier(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(name) for name in ("slow", *IMPLYING_SLOW, *OTHER_ENVIRONMENT_MARKERS))


@dataclass
class Timed:
    nodeid: str
    default_tier: bool
    outcome: str
    wall_s: float
    cpu_s: float


class Tiers:
    def __init__(self) -> None:
        self.budget_cpu_s = budget_from_environment("STAPO_TEST_BUDGET_CPU_S", DEFAULT_BUDGET_CPU_S)
        self.budget_wall_s = budget_from_environment("STAPO_TEST_BUDGET_WALL_S", None)
        self.times_path = os.environ.get("STAPO_TEST_TIMES") or None
        self.started: dict[str, tuple[float, float]] = {}
        self.times: list[Timed] = []
        self.over_budget: list[Timed] = []
        self.session_start = (time.perf_counter(), cpu_seconds())

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Before ``-m`` deselects (tryfirst), so that ``-m slow`` and its negation see the implied marker."""
        for item in items:
            if not item.get_closest_marker("slow") and any(item.get_closest_marker(name) for name in IMPLYING_SLOW):
                item.add_marker(pytest.mark.slow)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.started[item.nodeid] = (time.perf_counter(), cpu_seconds())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        ran = report.when == "call" or (report.when == "setup" and not report.passed)
        if not ran or item.nodeid not in self.started:
            return report
        wall_start, cpu_start = self.started.pop(item.nodeid)
        timed = Timed(
            nodeid=item.nodeid,
            default_tier=in_default_tier(item),
            outcome=report.outcome,
            wall_s=time.perf_counter() - wall_start,
            cpu_s=cpu_seconds() - cpu_start,
        )
        self.times.append(timed)
        over = self.over_budget_message(timed)
        if over and report.passed:
            report.outcome = "failed"
            report.longrepr = over
            timed.outcome = "failed"
            self.over_budget.append(timed)
        return report

    def over_budget_message(self, timed: Timed) -> str | None:
        if not timed.default_tier:
            return None
        exceeded = []
        if timed.cpu_s > self.budget_cpu_s:
            exceeded.append(f"{timed.cpu_s:.1f} s of CPU time, over the budget of {self.budget_cpu_s:g} s")
        if self.budget_wall_s is not None and timed.wall_s > self.budget_wall_s:
            exceeded.append(f"{timed.wall_s:.1f} s of wall time, over the budget of {self.budget_wall_s:g} s")
        if not exceeded:
            return None
        return (
            f"{timed.nodeid} passed but took {' and '.join(exceeded)} (setup and call) for a test of the default "
            "tier. Make it cheaper (a shared fixture, a tiny model built in code) or mark it @pytest.mark.slow, "
            "which moves it to the slow tier (python -m pytest -m slow)."
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.times:
            return
        wall = time.perf_counter() - self.session_start[0]
        cpu = cpu_seconds() - self.session_start[1]
        default = [t for t in self.times if t.default_tier]
        write = terminalreporter.write_line
        terminalreporter.section("time budget")
        write(
            f"this run: {len(self.times)} tests ({len(default)} of the default tier) in {wall:.0f} s of wall time, "
            f"{cpu:.0f} s of CPU time"
        )
        budgets = f"{self.budget_cpu_s:g} s of CPU time"
        if self.budget_wall_s is not None:
            budgets += f" and {self.budget_wall_s:g} s of wall time"
        write(f"budget per default-tier test: {budgets} (setup and call)")
        for label, tests in (
            ("default tier", default),
            ("other tiers", [t for t in self.times if not t.default_tier]),
        ):
            if not tests:
                continue
            write(f"slowest of the {label} by CPU time (CPU s, wall s):")
            for timed in sorted(tests, key=lambda t: t.cpu_s, reverse=True)[:SHOWN]:
                write(f"  {timed.cpu_s:7.1f} {timed.wall_s:7.1f}  {timed.nodeid}")
        for timed in self.over_budget:
            write(f"OVER BUDGET: {timed.nodeid} ({timed.cpu_s:.1f} s CPU, {timed.wall_s:.1f} s wall)", red=True)
        if self.times_path:
            Path(self.times_path).write_text(json.dumps([asdict(t) for t in self.times], indent=1) + "\n")
            write(f"times of every test written to {self.times_path}")
