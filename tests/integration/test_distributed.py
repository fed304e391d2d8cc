"""Two processes (torchrun, gloo): the entropy pool and the kept-token count are global.

The mask each rank applies equals the single-process mask over the same global batch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from distributed_worker import global_batch

from stapo_trl import spurious_token_mask

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
TESTS = Path(__file__).resolve().parents[1]


def torchrun(mode, out_dir, **env):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(
        [*command, str(WORKER), mode, str(out_dir)], capture_output=True, text=True, env=environment, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def test_two_process_mask_equals_single_process_mask(tmp_path):
    ranks = torchrun("function", tmp_path)
    reference, reference_stats = spurious_token_mask(*global_batch())
    assert reference.sum() > 0
    assert torch.equal(torch.cat([rank["spurious"] for rank in ranks]), reference)
    for rank in ranks:
        for key, value in reference_stats.items():
            assert rank["stats"][key] == pytest.approx(value), key


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_process_training_pools_every_micro_batch_of_the_step(tmp_path, loss_type):
    ranks = torchrun("trainer", tmp_path, LOSS_TYPE=loss_type)
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    steps = list(zip(ranks[0]["records"], ranks[1]["records"], strict=True))
    assert len(steps) == 2
    masked = 0
    for step in steps:
        pooled = {key: torch.cat([record[key] for record in step]) for key in ("log_probs", "entropies", "advantages")}
        loss_mask = torch.cat([record["loss_mask"] for record in step])
        reference, stats = spurious_token_mask(
            pooled["log_probs"], pooled["entropies"], pooled["advantages"], loss_mask, prob_threshold=0.05
        )
        applied = torch.cat([record["tool_mask"] for record in step]) == 0
        assert torch.equal(applied, reference)
        assert step[0]["stats"]["num_silenced"] == step[1]["stats"]["num_silenced"] == stats["num_spurious"]
        assert step[0]["stats"]["entropy_threshold"] == pytest.approx(stats["entropy_threshold"])
        # num_items_in_batch is the global count of kept tokens of the step (one generation per step here).
        kept = int(loss_mask.sum()) - stats["num_spurious"]
        for record in step:
            assert record["num_items_in_batch"] == [kept] * len(record["num_items_in_batch"])
        masked += stats["num_spurious"]
    assert masked > 0


def test_stapo_trl_train_with_two_processes_on_the_cpu_trains_in_both(tmp_path, tiny_model_dir):
    """`stapo-trl train --num_processes 2` on the CPU (it runs `accelerate launch`, which alone would start one
    process there) trains in two processes that form one group: both score completions, and the first step counts
    the prompt and completion tokens of both."""
    recipe = {
        "model_name_or_path": str(tiny_model_dir),
        "dataset_name": "sample",
        "prompt_style": "boxed",
        "reward_funcs": ["boxed", "rank_probe.record_rank"],
        "max_prompt_tokens": 700,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 1,
        "bf16": False,
        "activation_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
    }

    def train(name: str, *launch: str) -> dict:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**recipe, "output_dir": str(tmp_path / name)}))
        environment = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "RANK_PROBE_FILE": str(tmp_path / f"{name}-ranks.txt"),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "stapo_trl", "train", "--config", str(path), *launch]
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        return {"ranks": sorted(set((tmp_path / f"{name}-ranks.txt").read_text().split())), "tokens": first}

    # port 0: a free port that accelerate picks, not 29500, which a launch in another CI lane may hold
    two = train("two", "--num_processes", "2", "--main_process_port", "0")
    one = train("one")
    assert two["ranks"] == ["0", "1"] and one["ranks"] == ["none"]
    assert two["tokens"]["num_tokens"] > 1.5 * one["tokens"]["num_tokens"]
