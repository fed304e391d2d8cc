"""Checkpoint and resume: a run stopped or killed and then resumed ends exactly where a straight run ends.

`resume_worker.build_trainer` is a 6-step run (4 steps per epoch) with S2T, adaptive STARE and the token dump, real
sampling on the CPU and a checkpoint at every step. The straight run is the reference for the parameters, the logged
history, the STARE controller, the sampled completions and the dump files. transformers' end-of-training summary
(`train_loss`, `train_runtime`) covers only the session that ran it, so it is the one logged entry not compared.
"""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from resume_worker import TOTAL_STEPS, build_trainer
from transformers import TrainerCallback
from trl import GRPOTrainer

from stapo_trl.core.resume import resolve_resume_checkpoint

WORKER = Path(__file__).with_name("resume_worker.py")
TIMING_KEYS = {"step_time"}
PARAMETER_TOLERANCE = 1e-6


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def outcome(trainer):
    output_dir = Path(trainer.args.output_dir)
    completions = {}
    with open(output_dir / "completions.jsonl") as file:
        for line in file:
            record = json.loads(line)
            completions[record["step"]] = record["completions"]
    return {
        "parameters": {name: value.detach().clone() for name, value in trainer.model.named_parameters()},
        "history": [
            {key: value for key, value in entry.items() if key not in TIMING_KEYS}
            for entry in trainer.state.log_history
            if "train_loss" not in entry
        ],
        "controller": trainer.rule_controllers["stare"].state_dict(),
        "completions": completions,
        "dump": (output_dir / "silenced_tokens.jsonl").read_text(),
        "dump_stats": json.loads((output_dir / "silenced_tokens_stats.json").read_text()),
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run here uses one torch thread, as the signalled workers do (OMP_NUM_THREADS=1): the statistics recorded
    while sampling come from small per-step matrix products, whose rounding depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, one_thread):
    trainer = build_trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return outcome(trainer)


def assert_same_run(resumed, straight):
    assert resumed["completions"] == straight["completions"]
    assert sorted(resumed["completions"]) == list(range(1, TOTAL_STEPS + 1))
    assert resumed["history"] == straight["history"]
    assert resumed["controller"] == straight["controller"]
    assert resumed["dump"] == straight["dump"] and resumed["dump_stats"] == straight["dump_stats"]
    for name, value in straight["parameters"].items():
        assert (resumed["parameters"][name] - value).abs().max() <= PARAMETER_TOLERANCE, name


def test_the_reference_run_exercises_every_piece_of_resumable_state(straight):
    assert straight["controller"]["num_updates"] == TOTAL_STEPS and straight["controller"]["positive_weight"] > 1.1
    assert sum(entry.get("s2t/num_silenced", 0) for entry in straight["history"]) > 0
    assert straight["dump_stats"]["written"] > 0
    assert len({json.dumps(straight["completions"][step]) for step in straight["completions"]}) == TOTAL_STEPS


@pytest.mark.parametrize("stop_after", [3, 4], ids=["mid-epoch", "epoch-boundary"])
def test_a_stopped_and_resumed_run_matches_the_straight_run(tmp_path, straight, stop_after):
    first = build_trainer(tmp_path)
    first.add_callback(StopAfter(stop_after))
    first.train()
    assert first.state.global_step == stop_after
    resumed = build_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == TOTAL_STEPS
    assert_same_run(outcome(resumed), straight)


def run_until_signalled(output_dir, kind, step):
    result = subprocess.run(
        [sys.executable, str(WORKER), str(output_dir), kind, str(step)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    return result


def test_a_run_terminated_mid_step_resumes_from_its_last_checkpoint(tmp_path, straight):
    result = run_until_signalled(tmp_path, "term-mid-step", 5)
    assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == [
        f"checkpoint-{step}" for step in range(1, 5)
    ]
    assert resolve_resume_checkpoint(True, tmp_path) == str(tmp_path / "checkpoint-4")
    resumed = build_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(outcome(resumed), straight)


def test_a_run_killed_while_saving_resumes_from_the_checkpoint_before(tmp_path, straight, caplog):
    result = run_until_signalled(tmp_path, "kill-mid-save", 3)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    interrupted = tmp_path / "checkpoint-3"
    assert (interrupted / "model.safetensors").is_file() and not (interrupted / "trainer_state.json").exists()

    with pytest.raises(
        ValueError,
        match=r"checkpoint-3 has no trainer_state.json: its save was interrupted.*"
        r"The newest complete checkpoint is .*checkpoint-2",
    ):
        resolve_resume_checkpoint(str(interrupted), tmp_path)
    with caplog.at_level(logging.WARNING, logger="stapo_trl.core.resume"):
        assert resolve_resume_checkpoint("true", tmp_path) == str(tmp_path / "checkpoint-2")
    assert "Skipping" in caplog.text and "checkpoint-3" in caplog.text

    resumed = build_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert (interrupted / "trainer_state.json").is_file()
    assert_same_run(outcome(resumed), straight)


@pytest.mark.parametrize("value", [None, False, ""])
def test_no_resume_value_starts_fresh(tmp_path, value):
    assert resolve_resume_checkpoint(value, tmp_path) is None


@pytest.mark.parametrize("value", [True, "true", "True", "last"])
def test_resuming_the_last_checkpoint_of_an_empty_output_dir_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match="holds no complete checkpoint-N directory"):
        resolve_resume_checkpoint(value, tmp_path)


def test_resuming_from_a_path_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-9"), tmp_path)


def test_every_epoch_keeps_trls_order_even_when_set_out_of_turn(tmp_path):
    trainer = build_trainer(tmp_path)
    reference = GRPOTrainer._get_train_sampler(trainer)
    straight_epochs = [list(reference) for _ in range(3)]
    assert straight_epochs[0] != straight_epochs[1] != straight_epochs[2]
    sampler = trainer._get_train_sampler()
    for epoch in (0, 1, 2, 1, 2, 0):
        sampler.set_epoch(epoch)
        assert list(sampler) == straight_epochs[epoch], epoch
