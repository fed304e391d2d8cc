"""Run by ``accelerate launch`` with a DeepSpeed config from test_deepspeed.py: a few STAPO steps of the tiny Qwen3,
after which each rank writes to OUT_DIR what DeepSpeed ran with, the log history and how far each parameter moved.

usage: deepspeed_worker.py OUT_DIR MAX_STEPS
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for tiny.py


def main(out_dir, max_steps):
    import deepspeed

    # DeepSpeed JIT-compiles its shared-memory all-reduce op at its first comm init on CPU (1.5 to 4 minutes on 2
    # cores, again for every new virtualenv). Only inference_all_reduce (AutoTP) uses it; ZeRO's collectives go through
    # torch.distributed either way, so marking it incompatible skips the build and changes nothing in training.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from tiny import build_char_tokenizer, build_tiny_qwen3, tiny_config, tiny_trainer

    from stapo_trl import STAPOConfig, STAPOTrainer

    model = build_tiny_qwen3(build_char_tokenizer())
    initial = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    config = tiny_config(STAPOConfig, out_dir, max_steps=max_steps, prob_threshold=0.05)
    trainer = tiny_trainer(STAPOTrainer, config, model=model)
    trainer.train()

    engine = trainer.model_wrapped
    parameters = dict(trainer.accelerator.unwrap_model(engine).named_parameters())
    with deepspeed.zero.GatheredParameters(list(parameters.values())):
        max_abs_change = {
            name: (parameters[name].detach().float() - value).abs().max().item() for name, value in initial.items()
        }

    result = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world_size": trainer.accelerator.num_processes,
        "plugin_zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
        "engine_class": type(engine).__name__,
        "engine_zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
        "comm_backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "deepspeed_accelerator": deepspeed.get_accelerator().device_name(),
        "token_stats_backend": trainer.token_stats.backend,
        "log_history": trainer.state.log_history,
        "max_abs_change": max_abs_change,
    }
    with open(os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as file:
        json.dump(result, file, indent=1)
    # Without this, gloo's threads can abort the process at interpreter exit ("terminate called without an active
    # exception"), failing the run after training succeeded.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
