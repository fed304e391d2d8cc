"""Training runs shared by the equivalence, mask and cost sections: the scaled recipe's configuration, the trainers,
a callback that times each optimizer step and stops at the section's deadline, and what a run leaves to compare."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field

import torch
from transformers import PrinterCallback, TrainerCallback


def checkpointing_key(config_class) -> str:
    """transformers 5.24 renamed ``gradient_checkpointing`` to ``activation_checkpointing``; the GPU machine's
    transformers (5.17) has only the old name."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def recipe_config(
    config_class, plan, output_dir: str, *, max_steps: int, learning_rate: float, run=None, seed: int = 0, **extra
):
    """The Qwen3-1.7B STAPO recipe's settings at a scaled batch shape: ``run``, by default the plan's (see
    `gpu.plan`)."""
    run = run or plan.run
    values = {
        "output_dir": output_dir,
        "per_device_train_batch_size": run.per_device_train_batch_size,
        "num_generations": run.num_generations,
        "gradient_accumulation_steps": run.gradient_accumulation_steps,
        "steps_per_generation": run.steps_per_generation,
        "max_completion_length": run.max_completion_length,
        "temperature": 1.0,
        "top_p": 1.0,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "beta": 0.0,
        "loss_type": "dapo",
        "max_steps": max_steps,
        "bf16": True,
        checkpointing_key(config_class): True,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "seed": seed,
        "disable_tqdm": True,
        "use_cpu": plan.device == "cpu",
    }
    values.update(extra)
    return config_class(**values)


def stapo_settings(plan, environment: dict, **overrides) -> dict:
    """The recipe's STAPO fields: the paper's thresholds, statistics from the policy being optimized, and the
    statistics backend the setup section found runnable."""
    return {
        "prob_threshold": plan.prob_threshold,
        "entropy_quantile": plan.entropy_quantile,
        "token_stats_source": "loss",
        "token_stats_backend": environment.get("trainer_backend", "auto"),
        **overrides,
    }


class StepClock(TrainerCallback):
    """Times each optimizer step (generation included, on the device's clock) and stops training at the deadline."""

    def __init__(self, clock, device: str):
        self.clock = clock
        self.device = device
        self.step_seconds: list[float] = []
        self.cut_short = False
        self._started = None

    def _synchronize(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._synchronize()
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._synchronize()
        self.step_seconds.append(time.perf_counter() - self._started)
        if self.clock.left() <= 0 and state.global_step < state.max_steps:
            control.should_training_stop = True
            self.cut_short = True


@dataclass
class RunResult:
    label: str
    step_seconds: list[float]
    peak_bytes: int | None
    logs: list[dict]
    parameters: dict = field(default_factory=dict)
    cut_short: bool = False
    wall_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)


def step_logs(trainer) -> list[dict]:
    return [dict(entry) for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


def train(trainer, label: str, clock, device: str, keep_parameters: bool = False) -> RunResult:
    """Train, timed, with the peak device memory of the run (None on the CPU)."""
    timer = StepClock(clock, device)
    trainer.add_callback(timer)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    parameters = {}
    if keep_parameters:
        parameters = {name: value.detach().to("cpu", copy=True) for name, value in trainer.model.named_parameters()}
    return RunResult(label, timer.step_seconds, peak, step_logs(trainer), parameters, timer.cut_short, wall)


def build_trainer(kind: str, model, tokenizer, dataset, reward_funcs, config, trainer_class=None):
    """A `GRPOTrainer` (kind "grpo") or a `STAPOTrainer` (or ``trainer_class``) on ``model``."""
    from trl import GRPOTrainer

    from stapo_trl import STAPOTrainer

    trainer_class = trainer_class or (GRPOTrainer if kind == "grpo" else STAPOTrainer)
    trainer = trainer_class(
        model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)  # the check prints its own lines
    return trainer


def config_classes(kind: str):
    from trl import GRPOConfig

    from stapo_trl import STAPOConfig

    return GRPOConfig if kind == "grpo" else STAPOConfig


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="gpu-check-")


def free_memory() -> None:
    """Collect the trainers and models the caller has dropped and give their device memory back, so that the next
    run's peak starts clean."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
