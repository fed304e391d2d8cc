"""STAPO runs for the resume tests: S2T, adaptive STARE and the token dump on the tiny Qwen3, with real sampling.

usage: resume_worker.py OUT_DIR {term-mid-step,kill-mid-save} STEP

Run as a script, it trains until step STEP and then signals itself: SIGTERM while STEP's completions are being scored
(mid-step), or SIGKILL while checkpoint-STEP is being saved (after the weights, optimizer and RNG state, before
trainer_state.json).
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py

from tiny import (  # noqa: E402
    build_char_tokenizer,
    build_tiny_qwen3,
    count_vowels_reward,
    prompt_dataset,
    tiny_config,
    tools,
)

from stapo_trl import STAPOConfig, STAPOTrainer  # noqa: E402

TOTAL_STEPS = 6
STEPS_PER_EPOCH = 4
RULES = {
    "prob_threshold": 0.05,
    "use_stare": True,
    "stare_variant": "C2",
    "stare_target_entropy": 5.0,
    "stare_adaptive": True,
}
DUMP = {"dump_silenced_tokens": True, "dump_tokens_per_step": 3}


class CompletionLog:
    """A reward function that also appends each step's sampled completions to OUT_DIR/completions.jsonl."""

    __name__ = "count_vowels_reward"

    def __init__(self, path, kill_mid_step_at=None):
        self.path = Path(path)
        self.kill_mid_step_at = kill_mid_step_at

    def __call__(self, completions, trainer_state, **kwargs):
        step = trainer_state.global_step + 1
        with open(self.path, "a") as file:
            file.write(json.dumps({"step": step, "completions": completions}) + "\n")
        if step == self.kill_mid_step_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return count_vowels_reward(completions)


class KilledWhileSaving(STAPOTrainer):
    kill_mid_save_at = None

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if self.state.global_step == self.kill_mid_save_at:
            os.kill(os.getpid(), signal.SIGKILL)


def build_trainer(out_dir, kill=None, **overrides):
    """A trainer of the 6-step run (an epoch is 4 steps), saving a checkpoint at every step."""
    kind, step = kill or (None, None)
    tokenizer = build_char_tokenizer()
    config = tiny_config(
        STAPOConfig,
        out_dir,
        max_steps=TOTAL_STEPS,
        save_strategy="steps",
        save_steps=1,
        **{**RULES, **overrides},
    )
    trainer = KilledWhileSaving(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=CompletionLog(Path(out_dir) / "completions.jsonl", step if kind == "term-mid-step" else None),
        args=config,
        train_dataset=prompt_dataset(2 * STEPS_PER_EPOCH),
        processing_class=tokenizer,
        callbacks=tools(**DUMP),
    )
    trainer.kill_mid_save_at = step if kind == "kill-mid-save" else None
    return trainer


if __name__ == "__main__":
    out_dir, kind, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    build_trainer(out_dir, kill=(kind, step)).train()
