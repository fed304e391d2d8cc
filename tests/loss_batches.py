"""Hand-made TRL micro-batches with known statistics, and a tiny trainer to compute their loss.

The batches carry no old log-probabilities, so in TRL's loss the importance ratio is exactly 1 and each token's
clipped surrogate is -A (times any token-rule weight): expected losses can be computed by hand.
"""

import math

import torch
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    ENTROPIES_KEY,
    LOG_PROBS_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    TOOL_MASK_BEFORE_RULES_KEY,
)

LOW, HIGH = math.log(0.001), math.log(0.9)


def make_trainer(tmp_path, **overrides):
    values = {"per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 3}
    values.update(overrides)
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, **values))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.token_stats.generation_step = trainer.state.global_step
    return trainer


def make_batch(log_probs, entropies, advantages, completion_mask=None, num_items=None):
    rows, tokens = log_probs.shape
    completion_mask = torch.ones(rows, tokens, dtype=torch.long) if completion_mask is None else completion_mask
    num_items = torch.tensor(int(completion_mask.sum())) if num_items is None else num_items
    return {
        "prompt_ids": torch.tensor([[5, 6]] * rows),
        "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.arange(7, 7 + rows * tokens).view(rows, tokens),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages),
        ADVANTAGES_BEFORE_RULES_KEY: torch.tensor(advantages),
        "num_items_in_batch": num_items,
        LOG_PROBS_KEY: log_probs,
        ENTROPIES_KEY: entropies,
        TOOL_MASK_BEFORE_RULES_KEY: None,
        NUM_ITEMS_BEFORE_RULES_KEY: num_items,
    }
