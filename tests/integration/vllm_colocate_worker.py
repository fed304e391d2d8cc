"""One training run through TRL's colocated vLLM on the CPU, with probes; run as its own process by
test_vllm_colocate.py (plainly, or under ``torchrun --nproc_per_node 2``).

usage: vllm_colocate_worker.py SPEC_JSON OUT_DIR

The run trains the model at ``spec["model_path"]`` (test_vllm_colocate.py passes a tiny Llama built in code), else
SmolLM2-135M-Instruct (the quickstart's GGUF, converted once), on the quickstart's arithmetic task inside
`colocated_vllm_on_cpu()`, and writes ``OUT_DIR/rank{R}.json`` with what the probes saw:

- ``weight_probes``: before each vLLM generation (TRL has just synced the weights if a step happened), the per-token
  log-probs of a fixed continuation under vLLM (``prompt_logprobs``, taken before any temperature scaling, so the
  training temperature is 1.0) and under the policy (an HF forward in eval mode, no dropout, fp32);
- ``hf_generate_calls``, ``vllm_generations`` (TRL's calls to the engine, without the probes' own);
- ``policy_forwards``: calls of the policy's forward per generation batch and optimizer step (the probes excluded);
- ``token_stats_origins``: `STAPOTrainer.token_stats.origin` after each generation (STAPO only);
- ``log_history`` and a SHA-256 of the final parameters; ``s2t_records`` (the pooled step statistics and the mask each
  micro-batch received, as tensors in ``rank{R}.pt``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py

FIXED_QUESTION = "Lena has 4 kites and buys 3 more. How many kites does Lena have now?"
FIXED_CONTINUATION = "4 + 3 = 7\nAnswer: 7"
SYSTEM_PROMPT = 'Solve the problem. Reply with the calculation, then a last line "Answer: N".'


def build_config(spec: dict, out_dir: str):
    from trl import GRPOConfig

    from stapo_trl import STAPOConfig

    values = {
        "output_dir": out_dir,
        "per_device_train_batch_size": spec.get("per_device_train_batch_size", 8),
        "num_generations": spec.get("num_generations", 4),
        "max_completion_length": spec.get("max_completion_length", 24),
        "temperature": 1.0,
        "learning_rate": spec["learning_rate"],
        "lr_scheduler_type": "constant",
        "max_steps": spec.get("max_steps", 3),
        "epsilon_high": 0.28,
        "beta": 0.0,
        "loss_type": "dapo",
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_importance_sampling_correction": True,
        "vllm_max_model_length": 1024,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "save_strategy": "no",
        "seed": spec.get("seed", 0),
        "disable_tqdm": True,
    }
    if spec["trainer"] == "grpo":
        return GRPOConfig(**values)
    return STAPOConfig(
        **values, use_s2t_mask=spec.get("use_s2t_mask", True), prob_threshold=spec.get("prob_threshold", 0.002)
    )


def digest(model) -> str:
    hasher = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        hasher.update(name.encode())
        hasher.update(parameter.detach().float().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def main(spec: dict, out_dir: str) -> None:
    import transformers
    from peft import LoraConfig
    from trl import GRPOTrainer

    from stapo_trl import STAPOTrainer
    from stapo_trl.core.names import ENTROPIES_KEY, LOG_PROBS_KEY, TOOL_MASK_BEFORE_RULES_KEY
    from stapo_trl.cpu.colocated_vllm import colocated_vllm_on_cpu
    from stapo_trl.data.arithmetic import fewshot_prompt, load_arithmetic
    from stapo_trl.gguf import SMOLLM2_GGUF, gguf_checkpoint
    from stapo_trl.rewards import get_reward_func

    model_path = spec.get("model_path") or str(gguf_checkpoint(SMOLLM2_GGUF))
    config = build_config(spec, out_dir)
    dataset = load_arithmetic(64, seed=config.seed, num_fewshot=1, system_prompt=SYSTEM_PROMPT)
    peft_config = (
        LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
        if spec.get("peft")
        else None
    )

    counts = Counter()
    real_generate = transformers.GenerationMixin.generate

    def counting_generate(self, *args, **kwargs):
        counts["hf_generate"] += 1
        return real_generate(self, *args, **kwargs)

    transformers.GenerationMixin.generate = counting_generate

    base_class = GRPOTrainer if spec["trainer"] == "grpo" else STAPOTrainer
    records: list[dict] = []

    class ProbedTrainer(base_class):
        def on_optimizer_step_start(self, step_batches):
            super().on_optimizer_step_start(step_batches)
            if base_class is STAPOTrainer and self.token_rules:
                records.append(
                    {
                        "loss_mask": torch.cat(
                            [
                                b["completion_mask"]
                                * (1 if b[TOOL_MASK_BEFORE_RULES_KEY] is None else b[TOOL_MASK_BEFORE_RULES_KEY])
                                for b in step_batches
                            ]
                        ),
                        "tool_mask": torch.cat([b["tool_mask"] for b in step_batches]),
                        "advantages": torch.cat([b["advantages"] for b in step_batches]),
                        "log_probs": torch.cat([b[LOG_PROBS_KEY] for b in step_batches]),
                        "entropies": torch.cat([b[ENTROPIES_KEY] for b in step_batches]),
                        "old_per_token_logps": torch.cat([b["old_per_token_logps"] for b in step_batches]),
                        "num_items_in_batch": [int(b["num_items_in_batch"]) for b in step_batches],
                        "completion_ids": torch.cat([b["completion_ids"] for b in step_batches]),
                    }
                )

    reward_funcs = [get_reward_func("dapo")]
    if spec.get("vowel_reward"):
        from tiny import count_vowels_chat_reward

        # a dense reward with spread inside every group, so that advantages are never all zero
        reward_funcs.append(count_vowels_chat_reward)
    with colocated_vllm_on_cpu():
        trainer = ProbedTrainer(
            model=model_path,
            reward_funcs=reward_funcs,
            args=config,
            train_dataset=dataset,
            peft_config=peft_config,
        )
    tokenizer = trainer.processing_class
    generation = trainer.vllm_generation
    llm = generation.llm
    policy = trainer.model
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy

    prompt_ids = tokenizer.apply_chat_template(
        fewshot_prompt(FIXED_QUESTION, 1, "dapo", SYSTEM_PROMPT),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    prompt_ids = list(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids)
    continuation_ids = tokenizer(FIXED_CONTINUATION, add_special_tokens=False)["input_ids"]
    probe_ids = prompt_ids + continuation_ids

    probing = {"on": False}
    forwards = Counter()

    def count_forward(module, args, kwargs):
        if not probing["on"]:
            forwards[trainer.state.global_step] += 1

    base.register_forward_pre_hook(count_forward, with_kwargs=True)

    real_llm_generate = llm.generate

    def counting_llm_generate(*args, **kwargs):
        if not probing["on"]:
            counts["vllm_generate"] += 1
        return real_llm_generate(*args, **kwargs)

    llm.generate = counting_llm_generate

    def probe() -> dict:
        from vllm import SamplingParams

        probing["on"] = True
        try:
            output = llm.generate(
                [{"prompt_token_ids": probe_ids}],
                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                use_tqdm=False,
            )[0]
            vllm_logps = [
                output.prompt_logprobs[i][probe_ids[i]].logprob for i in range(len(prompt_ids), len(probe_ids))
            ]
            was_training = policy.training
            policy.eval()
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([probe_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
            policy.train(was_training)
            targets = torch.tensor(continuation_ids)
            hf_logps = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].tolist()
        finally:
            probing["on"] = False
        return {
            "global_step": trainer.state.global_step,
            "syncs": generation.syncs,
            "tied_kernels_rebuilt": generation.tied_kernels_rebuilt,
            "vllm": vllm_logps,
            "hf": hf_logps,
        }

    probes: list[dict] = []
    real_generation_generate = generation.generate

    timings = Counter()

    def timed(name, function):
        def call(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                timings[f"{name}_wall"] += time.perf_counter() - wall
                timings[f"{name}_cpu"] += time.process_time() - cpu

        return call

    generate_timed = timed("vllm_generate", real_generation_generate)

    def probed_generation_generate(*args, **kwargs):
        # TRL syncs the weights right before this call whenever an optimizer step happened since the last sync.
        if not spec.get("no_probe"):
            probes.append(probe())
        counts["trl_vllm_generate"] += 1
        return generate_timed(*args, **kwargs)

    generation.generate = probed_generation_generate
    generation.sync_weights = timed("sync_weights", generation.sync_weights)

    origins = []

    if base_class is STAPOTrainer:
        from transformers import TrainerCallback

        class RecordOrigin(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                origins.append(trainer.token_stats.origin if trainer.token_stats is not None else None)

        trainer.add_callback(RecordOrigin())

    threads_after_engine = torch.get_num_threads()
    trainer.train()
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "pid": os.getpid(),
        "engine_class": type(generation).__name__,
        "engine_id": id(llm),
        "threads_after_engine": threads_after_engine,
        "hf_generate_calls": counts["hf_generate"],
        "vllm_generations": counts["vllm_generate"],
        "trl_vllm_generate_calls": counts["trl_vllm_generate"],
        "syncs": generation.syncs,
        "weight_probes": probes,
        "policy_forwards": {str(step): count for step, count in sorted(forwards.items())},
        "token_stats_origins": origins,
        "log_history": trainer.state.log_history,
        "parameters_sha256": digest(trainer.model),
        "timings": dict(timings),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    torch.save(records, Path(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter teardown with vLLM's engine and gloo threads alive can abort after a successful run.
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
