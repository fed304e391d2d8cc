"""Ctrl-C or SIGTERM (what Slurm, Kubernetes and spot preemption send) during `stapo-trl train`: the run stops at a
checkpoint even with save_strategy "no", says how to resume, exits 130 or 143, and the printed command completes the
run with every step logged once. With two processes, a signal to either stops both after the same step."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny import save_tiny_chat_model

REPO = Path(__file__).resolve().parents[2]

# Each test trains in two or three processes of its own (20 to 40 s of CPU time): the slow tier.
pytestmark = pytest.mark.slow

ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "stapo_trl", "train", *arguments]


def start_training(recipe: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_command("--config", str(recipe), *flags),
        cwd=REPO,
        env=ENVIRONMENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_training(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(*arguments), cwd=REPO, env=ENVIRONMENT, capture_output=True, text=True, timeout=300
    )


def wait_for_step(metrics: Path, process: subprocess.Popen, step: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"training ended before step {step}:\n{process.stderr.read()[-3000:]}")
        if metrics.is_file() and re.search(rf'"step": {step}[,}}]', metrics.read_text()):
            return
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture
def recipe(tmp_path) -> Path:
    model = save_tiny_chat_model(tmp_path / "model")
    path = tmp_path / "recipe.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(model),
                "dataset_name": "sample",
                "reward_funcs": ["boxed"],
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 8,
                "max_steps": 400,
                "logging_steps": 1,
                "use_cpu": True,
                "bf16": False,
                "report_to": "none",
                "save_strategy": "no",
                "disable_tqdm": True,
                "output_dir": str(tmp_path / "run"),
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("signum", "name", "code"), [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)]
)
def test_a_signal_saves_a_checkpoint_prints_the_resume_command_and_the_run_resumes(
    recipe, tmp_path, signum, name, code
):
    run = tmp_path / "run"
    process = start_training(recipe)
    wait_for_step(run / "metrics.jsonl", process, step=2)
    process.send_signal(signum)
    out, err = process.communicate(timeout=240)

    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err
    assert f"{name}: training stops after this optimizer step and saves a checkpoint" in err
    checkpoints = sorted(run.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert checkpoints and (checkpoints[-1] / "trainer_state.json").is_file()
    stopped_at = int(checkpoints[-1].name.split("-")[1])
    assert 2 <= stopped_at < 400
    assert not (run / "run_summary.json").exists()  # an interrupted run is not a finished one
    hint = err.strip().splitlines()[-1].strip()
    assert hint.startswith("stapo-trl train --config") and hint.endswith("--resume_from_checkpoint last"), err

    resumed = run_training(*shlex.split(hint)[2:], "--max_steps", str(stopped_at + 2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == stopped_at + 2
    steps = [record["step"] for record in state["log_history"] if "loss" in record]
    assert steps == list(range(1, stopped_at + 3))  # the steps before the interrupt and after the resume, once each


def test_a_second_run_into_a_finished_output_dir_is_refused_and_overwrite_replaces_it(recipe, tmp_path):
    first = run_training("--config", str(recipe), "--max_steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = (tmp_path / "run" / "run_summary.json").read_text()

    again = run_training("--config", str(recipe), "--max_steps", "1")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "holds an earlier run" in again.stderr and "--overwrite_output_dir true" in again.stderr
    assert (tmp_path / "run" / "run_summary.json").read_text() == summary  # untouched

    replaced = run_training("--config", str(recipe), "--max_steps", "2", "--overwrite_output_dir", "true")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "overwrite_output_dir: deleted the earlier run's" in replaced.stderr
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["steps"] == 2


def worker_pids(agent: subprocess.Popen) -> dict[int, int]:
    """The torchrun agent's worker processes, by rank."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = {}
        children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        for pid in map(int, children):
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks = [entry.split(b"=", 1)[1] for entry in environment if entry.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = pid
        if len(found) == 2:
            return found
        time.sleep(0.5)
    raise AssertionError("torchrun did not start two workers")


@pytest.mark.distributed
def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step_at_one_checkpoint(recipe, tmp_path):
    run = tmp_path / "run"
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + ["-m", "stapo_trl", "train", "--config", str(recipe), "--per_device_train_batch_size", "2"],
        cwd=REPO,
        env=ENVIRONMENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks = worker_pids(agent)
    wait_for_step(run / "metrics.jsonl", agent, step=2)
    os.kill(ranks[1], signal.SIGTERM)  # the non-main process: the main one must learn of it
    out, err = agent.communicate(timeout=300)

    assert "SIGTERM: training stops after this optimizer step" in err
    checkpoints = sorted(run.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.json").is_file(), err[-3000:]
    stopped_at = int(checkpoints[0].name.split("-")[1])
    state = json.loads((checkpoints[0] / "trainer_state.json").read_text())
    assert state["global_step"] == stopped_at >= 2
    assert "--resume_from_checkpoint last" in err
    assert err.count("Continue from it with:") == 1  # the main process prints the resume command, once
    # torchrun reports the first rank to exit; it then stops the other, so only the first is sure to show 143.
    assert "exitcode  : 143" in err, err[-4000:]  # torchrun's summary: which rank ended first, and how


@pytest.mark.parametrize("kill_after_step", [3, 4])
def test_after_sigkill_and_resume_every_run_file_holds_each_step_once(recipe, tmp_path, kill_after_step):
    """SIGKILL (no handler runs) once step ``kill_after_step`` is logged, with a checkpoint every 2 steps.

    After step 3 the kill lands in step 4, and checkpoint-2 is complete (it was saved before step 3 began). After
    step 4 it lands while checkpoint-4 is being saved or in step 5; checkpoint-2 is complete either way. The resumed
    run starts from the newest complete checkpoint, so it may log steps the killed one had logged already. After
    it, metrics.jsonl, the silenced-token dump's step counts and the run summary hold each of the 6 steps once.
    (A kill after step 2 could land before checkpoint-2 is complete, leaving no checkpoint to resume from.)"""
    run = tmp_path / "run"
    flags = ["--save_strategy", "steps", "--save_steps", "2", "--max_steps", "6"]
    flags += ["--dump_silenced_tokens", "true", "--prob_threshold", "0.5", "--temperature", "1.0"]
    process = start_training(recipe, *flags)
    wait_for_step(run / "metrics.jsonl", process, step=kill_after_step)
    process.kill()
    process.communicate(timeout=60)

    resumed = run_training("--config", str(recipe), *flags, "--resume_from_checkpoint", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics if "loss" in record] == [1, 2, 3, 4, 5, 6]
    dump_steps = [entry["step"] for entry in json.loads((run / "silenced_tokens_stats.json").read_text())["steps"]]
    assert dump_steps == sorted(set(dump_steps)) and set(dump_steps) <= set(range(1, 7))
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["steps"] == 6
    silenced = [record.get("s2t/num_silenced", 0) for record in metrics if "loss" in record]
    assert summary["token_rules"]["s2t"]["silenced_tokens"] == sum(silenced)
