"""Run by ``torchrun --nproc_per_node 2`` from test_distributed.py; writes each rank's results to OUT_DIR.

usage: distributed_worker.py {function,trainer} OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py


def global_batch():
    """The global batch the single-process reference also sees: 8 rows, 6 tokens, many candidates."""
    generator = torch.Generator().manual_seed(1234)
    log_probs = torch.log(torch.rand(8, 6, generator=generator) * 0.004)
    log_probs[:, ::3] = torch.log(torch.tensor(0.5))
    entropies = torch.rand(8, 6, generator=generator) * 3
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 1.0, -0.5, 1.5])
    loss_mask = torch.ones(8, 6, dtype=torch.long)
    loss_mask[2, 4:] = 0
    loss_mask[5, 1:] = 0  # rank 1 holds far fewer tokens than rank 0
    loss_mask[7, 2:] = 0
    return log_probs, entropies, advantages, loss_mask


def run_function(out_dir):
    from stapo_trl import spurious_token_mask

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = slice(0, 4) if rank == 0 else slice(4, 8)
    log_probs, entropies, advantages, loss_mask = global_batch()
    spurious, stats = spurious_token_mask(log_probs[rows], entropies[rows], advantages[rows], loss_mask[rows])
    torch.save({"spurious": spurious, "stats": stats}, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_after_every_rank_saved()


def run_trainer(out_dir):
    from tiny import tiny_config, tiny_trainer

    from stapo_trl import STAPOConfig, STAPOTrainer
    from stapo_trl.core.names import ENTROPIES_KEY, LOG_PROBS_KEY, TOOL_MASK_BEFORE_RULES_KEY

    class RecordingTrainer(STAPOTrainer):
        records = []

        def apply_token_rules(self, step_batches):
            stats = super().apply_token_rules(step_batches)["s2t"]
            self.records.append(
                {
                    "stats": stats,
                    "log_probs": torch.cat([b[LOG_PROBS_KEY] for b in step_batches]),
                    "entropies": torch.cat([b[ENTROPIES_KEY] for b in step_batches]),
                    "advantages": torch.cat([b["advantages"] for b in step_batches]),
                    "loss_mask": torch.cat(
                        [
                            b["completion_mask"]
                            * (1 if b[TOOL_MASK_BEFORE_RULES_KEY] is None else b[TOOL_MASK_BEFORE_RULES_KEY])
                            for b in step_batches
                        ]
                    ),
                    "tool_mask": torch.cat([b["tool_mask"] for b in step_batches]),
                    "num_items_in_batch": [int(b["num_items_in_batch"]) for b in step_batches],
                }
            )
            return {"s2t": stats}

    config = tiny_config(
        STAPOConfig,
        out_dir,
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        prob_threshold=0.05,
        loss_type=os.environ.get("LOSS_TYPE", "dapo"),
    )
    trainer = tiny_trainer(RecordingTrainer, config)
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {"records": trainer.records, "world_size": trainer.accelerator.num_processes},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    exit_after_every_rank_saved()


def exit_after_every_rank_saved():
    """Wait until every rank has written its file, then leave without interpreter teardown. With or without
    ``destroy_process_group``, gloo's threads sometimes abort a rank at exit ("terminate called without an active
    exception", SIGABRT), failing the launch after training succeeded (seen once in CI, 2026-11-25)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    {"function": run_function, "trainer": run_trainer}[mode](out_dir)
