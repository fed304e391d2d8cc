"""GRPOTrainer and STAPOTrainer, each asked for `use_liger_kernel=True`, in a process of their own.

usage: liger_worker.py OUT_DIR; prints one JSON line: for each trainer, the exception type and message training
stopped with (or null if it trained).

Liger's `apply_liger_kernel_to_*` replaces classes and functions in the transformers modeling module itself (for
Qwen3: `Qwen3RMSNorm`, `Qwen3MLP`, `apply_rotary_pos_emb`), so every model built afterwards in the same process gets
Triton kernels. Running here keeps that out of the test process.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py

from tiny import count_vowels_reward, prompt_dataset, save_tiny_chat_model, tiny_config  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from stapo_trl import STAPOConfig, STAPOTrainer  # noqa: E402


def outcome(trainer_class, config_class, model: Path, output_dir: Path, **options) -> list[str] | None:
    config = tiny_config(config_class, output_dir, use_liger_kernel=True, **options)
    trainer = trainer_class(
        model=str(model), args=config, reward_funcs=count_vowels_reward, train_dataset=prompt_dataset()
    )
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return [type(error).__name__, str(error)]
    return None


def main() -> None:
    out = Path(sys.argv[1])
    model = save_tiny_chat_model(out / "model")
    result = {
        "grpo": outcome(GRPOTrainer, GRPOConfig, model, out / "grpo", epsilon_high=0.28),
        "stapo": outcome(STAPOTrainer, STAPOConfig, model, out / "stapo", prob_threshold=0.05),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
