"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU: STAPO trains under both, with one process and with two (gloo).

The runs use the recipes' accelerate configs as shipped (recipes/accelerate/zero2.yaml, zero3.yaml). The command line
only sets the process count and ``--mixed_precision no``: the tiny model trains in fp32, and DeepSpeed refuses a bf16
config under ``bf16=False`` training arguments.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer import S2T_METRICS
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install -e '.[dev]' or -e '.[deepspeed]')",
    ),
]

WORKER = Path(__file__).with_name("deepspeed_worker.py")
ACCELERATE_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"
MAX_STEPS = 3
RUNS = [
    pytest.param(3, 1, id="zero3-1proc"),
    pytest.param(2, 1, id="zero2-1proc"),
    pytest.param(3, 2, id="zero3-2proc", marks=pytest.mark.distributed),
    pytest.param(2, 2, id="zero2-2proc", marks=pytest.mark.distributed),
]


def launch(stage, num_processes, out_dir):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / f"zero{stage}.yaml"),
        "--num_processes",
        str(num_processes),
        "--main_process_port",  # 0: a free port that accelerate picks, not 29500, which another launch may hold
        "0",
        "--mixed_precision",
        "no",
        str(WORKER),
        str(out_dir),
        str(MAX_STEPS),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(num_processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {}

    def run(stage, num_processes):
        if (stage, num_processes) not in done:
            out_dir = tmp_path_factory.mktemp(f"zero{stage}_{num_processes}proc")
            done[stage, num_processes] = launch(stage, num_processes, out_dir)
        return done[stage, num_processes]

    return run


def training_logs(rank):
    return [entry for entry in rank["log_history"] if "loss" in entry]


@pytest.mark.parametrize("stage, num_processes", RUNS)
def test_stapo_trains_under_deepspeed_zero_on_cpu_and_logs_the_mask(runs, stage, num_processes):
    ranks = runs(stage, num_processes)
    for rank in ranks:
        assert rank["distributed_type"] == "DistributedType.DEEPSPEED"
        assert rank["engine_class"] == "DeepSpeedEngine"
        assert rank["plugin_zero_stage"] == rank["engine_zero_stage"] == stage
        assert rank["deepspeed_accelerator"] == "cpu"
        assert rank["comm_backend"] == "gloo"
        assert rank["world_size"] == num_processes
        assert rank["token_stats_backend"] == ("trl_fused_head" if stage == 3 else "torch")

        logs = training_logs(rank)
        assert len(logs) == MAX_STEPS
        for entry in logs:
            assert set(S2T_METRICS) <= entry.keys()
            assert entry["s2t/num_silenced"] <= entry["s2t/num_candidates"]
        assert max(entry["s2t/num_silenced"] for entry in logs) > 0

        unchanged = [name for name, change in rank["max_abs_change"].items() if change == 0]
        assert unchanged == []

    first, *others = ranks
    for other in others:
        assert [{key: entry[key] for key in S2T_METRICS} for entry in training_logs(other)] == [
            {key: entry[key] for key in S2T_METRICS} for entry in training_logs(first)
        ]


def test_single_process_zero2_and_zero3_train_like_a_run_without_deepspeed(runs, tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, max_steps=MAX_STEPS, prob_threshold=0.05)
    trainer = tiny_trainer(STAPOTrainer, config)
    trainer.train()
    reference = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert sum(entry["s2t/num_silenced"] for entry in reference) > 0

    for stage in (3, 2):
        (rank,) = runs(stage, 1)
        logs = training_logs(rank)
        assert [entry["s2t/num_silenced"] for entry in logs] == [entry["s2t/num_silenced"] for entry in reference]
        assert [entry["s2t/num_candidates"] for entry in logs] == [entry["s2t/num_candidates"] for entry in reference]
        assert [entry["loss"] for entry in logs] == pytest.approx([entry["loss"] for entry in reference], abs=1e-6)
        assert [entry["grad_norm"] for entry in logs] == pytest.approx(
            [entry["grad_norm"] for entry in reference], rel=1e-4
        )


@pytest.mark.distributed
def test_two_process_zero3_shards_train_like_zero2(runs):
    zero3, zero2 = runs(3, 2)[0], runs(2, 2)[0]
    logs3, logs2 = training_logs(zero3), training_logs(zero2)
    assert [entry["s2t/num_silenced"] for entry in logs3] == [entry["s2t/num_silenced"] for entry in logs2]
    assert sum(entry["s2t/num_silenced"] for entry in logs3) > 0
    assert [entry["loss"] for entry in logs3] == pytest.approx([entry["loss"] for entry in logs2], abs=1e-6)
    assert [entry["grad_norm"] for entry in logs3] == pytest.approx([entry["grad_norm"] for entry in logs2], rel=1e-4)
