"""One STAPO training run on replayed completions, for comparing 2 processes (torchrun) with 1 (plain python).

usage: replay_worker.py OUT_DIR CASE [CASE ...], where a case is RULE:LOSS_TYPE:GRADIENT_ACCUMULATION (see `CASES`);
each case trains a fresh trainer and writes OUT_DIR/CASE/rank{R}.pt.

Generation is the only part of a GRPO step whose randomness depends on how the batch is split over processes, so
`ReplayTrainer` replaces the sampler with completions drawn from a generator seeded by the row's position in the
global batch. Everything after it (rewards, advantages gathered over processes, old log-probs, the token rules, the
loss and the optimizer step) is the real trainer. With the same global batch and seed, both launches must then agree
on the masks, tau_h, the kept-token counts, the loss and the parameters.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py

PAD_ID = 0
GLOBAL_ROWS_PER_STEP = 16
COMPLETION_LENGTH = 8
FIRST_CHARACTER_ID = 3


def replayed_completion(generation: int, global_row: int, vocab_size: int) -> list[int]:
    """The completion of one global row of one generation: the same whichever process generates it."""
    generator = torch.Generator().manual_seed(100_003 * generation + global_row)
    length = int(torch.randint(3, COMPLETION_LENGTH + 1, (1,), generator=generator))
    tokens = torch.randint(FIRST_CHARACTER_ID, vocab_size, (length,), generator=generator).tolist()
    return tokens if length == COMPLETION_LENGTH else [*tokens, 1]


STARE_GATE_ON = {
    "stare_variant": "C2",
    "stare_top_surprisal_share": 0.2,
    "stare_target_entropy": 5.0,
    "stare_adaptive": True,
}
DUMP = {"s2t": {"dump_silenced_tokens": True, "dump_tokens_per_step": 5, "dump_context_tokens": 3}}
"""The silenced-token dump's settings, by rule case."""
RULES = {
    "s2t": {"prob_threshold": 0.05},
    "stare_micro_batch": {
        "use_s2t_mask": False,
        "use_stare": True,
        "stare_selection_pool": "micro_batch",
        **STARE_GATE_ON,
    },
    "stare_optimizer_step": {
        "use_s2t_mask": False,
        "use_stare": True,
        "stare_selection_pool": "optimizer_step",
        **STARE_GATE_ON,
    },
}


def run(out_dir, case):
    from tiny import tiny_config, tiny_trainer, tools
    from transformers import TrainerCallback

    from stapo_trl import STAPOConfig, STAPOTrainer
    from stapo_trl.core.names import (
        ADVANTAGES_BEFORE_RULES_KEY,
        ENTROPIES_KEY,
        LOG_PROBS_KEY,
        SILENCED_KEY,
        TOKEN_WEIGHTS_KEY,
    )

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rule, loss_type, accumulation = case.split(":")
    accumulation = int(accumulation)
    out_dir = os.path.join(out_dir, case.replace(":", "-"))
    os.makedirs(out_dir, exist_ok=True)

    class ReplayTrainer(STAPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.generations = 0
            self.records = []

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            offset = self.accelerator.process_index * len(prompt_ids)
            vocab_size = self.model.config.vocab_size
            completions = [
                replayed_completion(self.generations, offset + row, vocab_size) for row in range(len(prompt_ids))
            ]
            self.generations += 1
            return completions, None

        def apply_token_rules(self, step_batches):
            stats = super().apply_token_rules(step_batches)
            loss_mask = torch.cat([self._loss_mask_before_rules(batch) for batch in step_batches])
            self.records.append(
                {
                    "stats": stats,
                    "prompt_ids": [row for batch in step_batches for row in batch["prompt_ids"].tolist()],
                    "completion_ids": [row for batch in step_batches for row in batch["completion_ids"].tolist()],
                    "silenced": torch.cat([batch[SILENCED_KEY] for batch in step_batches]),
                    "weights": None
                    if step_batches[0][TOKEN_WEIGHTS_KEY] is None
                    else torch.cat([batch[TOKEN_WEIGHTS_KEY] for batch in step_batches]),
                    "loss_mask": loss_mask,
                    "log_probs": torch.cat([batch[LOG_PROBS_KEY] for batch in step_batches]),
                    "entropies": torch.cat([batch[ENTROPIES_KEY] for batch in step_batches]),
                    "advantages": torch.cat([batch[ADVANTAGES_BEFORE_RULES_KEY] for batch in step_batches]),
                    "micro_batch_rows": [batch["completion_ids"].size(0) for batch in step_batches],
                    "num_items_in_batch": [int(batch["num_items_in_batch"]) for batch in step_batches],
                }
            )
            return stats

    class ParameterSnapshots(TrainerCallback):
        def __init__(self):
            self.snapshots = []

        def snapshot(self, model):
            self.snapshots.append({name: value.detach().clone() for name, value in model.named_parameters()})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.snapshot(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.snapshot(model)

    config = tiny_config(
        STAPOConfig,
        out_dir,
        max_steps=2,
        per_device_train_batch_size=GLOBAL_ROWS_PER_STEP // (world_size * accumulation),
        gradient_accumulation_steps=accumulation,
        max_completion_length=COMPLETION_LENGTH,
        loss_type=loss_type,
        optim="sgd",
        learning_rate=0.5,
        **RULES[rule],
    )
    snapshots = ParameterSnapshots()
    trainer = tiny_trainer(ReplayTrainer, config, callbacks=[snapshots, *tools(**DUMP.get(rule, {}))])
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "world_size": trainer.accelerator.num_processes,
            "records": trainer.records,
            "log_history": trainer.state.log_history,
            "parameters": snapshots.snapshots,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def launch(out_dir: Path, processes: int, cases: list[str]) -> dict[str, list[dict]]:
    """Run the cases in one launch (plain python for 1 process, torchrun for more); each case's results by rank."""
    prefix = [sys.executable]
    if processes > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    result = subprocess.run(
        [*prefix, __file__, str(out_dir), *cases],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{processes}-process launch failed:\n{result.stdout[-3000:]}{result.stderr[-5000:]}")
    return {
        case: [
            torch.load(out_dir / case.replace(":", "-") / f"rank{rank}.pt", weights_only=False)
            for rank in range(processes)
        ]
        for case in cases
    }


def trimmed(row: list[int]) -> tuple[int, ...]:
    return tuple(token for token in row if token != PAD_ID)


def rows_by_identity(ranks: list[dict], step: int) -> dict[tuple, dict]:
    """Each completion row of one optimizer step, over all processes, keyed by its (prompt, completion) tokens: TRL
    shuffles a generation before splitting it, so launches over different process counts order rows differently."""
    rows = {}
    for rank in ranks:
        record = rank["records"][step]
        for index, (prompt, completion) in enumerate(zip(record["prompt_ids"], record["completion_ids"], strict=True)):
            key = (trimmed(prompt), trimmed(completion))
            length = len(key[1])
            weights = record["weights"]
            rows[key] = {
                "silenced": record["silenced"][index, :length],
                "weights": None if weights is None else weights[index, :length],
            }
    return rows


if __name__ == "__main__":
    for case in sys.argv[2:]:
        run(sys.argv[1], case)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
