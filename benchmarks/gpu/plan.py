"""The sizes, budgets and settings of one GPU-check run: the real shapes on CUDA, toy sizes on the CPU.

The training runs follow the Qwen3-1.7B STAPO recipe (`recipes/dapo_math_17k/qwen3-1.7b-base/stapo.yaml`) scaled to
minutes: bf16 weights and autocast, gradient checkpointing, the dapo loss with eps_high 0.28, beta 0, temperature
1.0, token_stats_source "loss", and 4 optimizer steps per generation (steps_per_generation = 4 x gradient
accumulation, as the recipe's 64 = 4 x 16), with 4 completions per micro-batch and 8 per prompt, as the recipe.
What is scaled down: gradient accumulation (2 instead of 16), the completion length and the number of processes (1).
The ``quickstart`` section runs the quickstart recipe itself (`QuickstartPlan`: on CUDA only the flags that move it
to the GPU); ``first-run`` runs the ``equivalence`` section's model, steps and learning rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .models import QWEN3_0_6B, QWEN3_1_7B, TOY_SMALL, ModelShape


@dataclass(frozen=True)
class RunShape:
    """The batch shape of the training runs."""

    per_device_train_batch_size: int = 4
    num_generations: int = 8
    gradient_accumulation_steps: int = 2
    steps_per_generation: int = 8
    max_completion_length: int = 128
    num_prompts: int = 64

    @property
    def completions_per_generation(self) -> int:
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def steps_per_cycle(self) -> int:
        """Optimizer steps per generation."""
        return self.steps_per_generation // self.gradient_accumulation_steps


@dataclass(frozen=True)
class KernelShape:
    tokens: int
    hidden: int
    vocab: int
    repeats: int
    reference_rows: int
    """Rows per chunk of the fp64 reference."""


@dataclass(frozen=True)
class QuickstartPlan:
    """The ``quickstart`` section: `stapo-trl train` flags added to the quickstart recipe, and how many runs."""

    overrides: dict
    """Flag -> value, after the recipe's own keys (on CUDA: what moves it to the GPU; on the CPU: a smaller batch)."""
    warm_up_steps: int
    max_pairs: int
    """STAPO/GRPO pairs at most; fewer when the section's budget runs out."""
    first_run_estimate_s: float
    """Seconds the warm-up is given before it starts (the GGUF conversion on a fresh machine included)."""


GPU_QUICKSTART_FLAGS = {"use_cpu": "false", "bf16": "true", "dtype": "bfloat16"}


@dataclass(frozen=True)
class Plan:
    device: str
    deadline_s: float
    minimum_section_s: float
    budgets: dict
    kernel: KernelShape
    model: ModelShape
    """The model of the equivalence and mask sections."""
    cost_shapes: tuple[ModelShape, ...]
    run: RunShape
    mask_run: RunShape
    """The mask section's batch shape: S2T pools its candidates over each optimizer step, so the step must hold
    enough tokens for candidates (p < 0.002) of a trained model to appear."""
    equivalence_steps: int
    equivalence_learning_rate: float
    mask_steps: int
    sft_steps: int
    sft_seconds: float
    sft_batch: int
    sft_learning_rate: float
    cost_repeats: int
    quickstart: QuickstartPlan
    first_run_modes: tuple[str, ...]
    """The ``first-run`` section's attention modes, in order (`gpu.first_run`)."""
    first_run_estimate_s: float
    """Seconds one mode's process is given before it starts."""
    recipe_learning_rate: float = 1e-6
    prob_threshold: float = 0.002
    entropy_quantile: float = 0.8
    notes: list = field(default_factory=list)

    def describe(self) -> dict:
        described = asdict(self)
        described["model"] = self.model.name
        described["cost_shapes"] = [shape.name for shape in self.cost_shapes]
        return described


CUDA_PLAN = Plan(
    device="cuda",
    deadline_s=390.0,
    minimum_section_s=25.0,
    budgets={
        "setup": 30.0,
        "kernels": 70.0,
        "equivalence": 100.0,
        "mask": 90.0,
        "cost": 110.0,
        "quickstart": 190.0,
        "first-run": 130.0,
    },
    kernel=KernelShape(tokens=16384, hidden=2048, vocab=151936, repeats=3, reference_rows=512),
    model=QWEN3_0_6B,
    cost_shapes=(QWEN3_0_6B, QWEN3_1_7B),
    run=RunShape(max_completion_length=128),
    mask_run=RunShape(
        per_device_train_batch_size=16,
        gradient_accumulation_steps=4,
        steps_per_generation=16,
        max_completion_length=64,
        num_prompts=256,
    ),
    equivalence_steps=3,
    equivalence_learning_rate=1e-4,
    mask_steps=8,
    sft_steps=150,
    sft_seconds=35.0,
    sft_batch=32,
    sft_learning_rate=3e-4,
    cost_repeats=3,
    quickstart=QuickstartPlan(overrides=GPU_QUICKSTART_FLAGS, warm_up_steps=2, max_pairs=3, first_run_estimate_s=60.0),
    first_run_modes=("math", "default"),
    first_run_estimate_s=45.0,
)

CPU_PLAN = Plan(
    device="cpu",
    deadline_s=3600.0,
    minimum_section_s=5.0,
    budgets={
        "setup": 300.0,
        "kernels": 600.0,
        "equivalence": 900.0,
        "mask": 900.0,
        "cost": 900.0,
        "quickstart": 900.0,
        "first-run": 600.0,
    },
    kernel=KernelShape(tokens=700, hidden=64, vocab=1000, repeats=1, reference_rows=256),
    model=TOY_SMALL,
    cost_shapes=(TOY_SMALL,),
    run=RunShape(num_generations=4, steps_per_generation=6, max_completion_length=8, num_prompts=32),
    mask_run=RunShape(num_generations=4, steps_per_generation=6, max_completion_length=8, num_prompts=32),
    equivalence_steps=3,
    equivalence_learning_rate=1e-3,
    mask_steps=3,
    sft_steps=20,
    sft_seconds=600.0,
    sft_batch=16,
    sft_learning_rate=3e-3,
    cost_repeats=1,
    quickstart=QuickstartPlan(
        overrides={
            "max_steps": "1",
            "per_device_train_batch_size": "2",
            "num_generations": "2",
            "gradient_accumulation_steps": "1",
            "steps_per_generation": "1",
            "max_completion_length": "4",
            "num_train_problems": "8",
            "heldout_problems": "2",
            "heldout_max_new_tokens": "4",
        },
        warm_up_steps=1,
        max_pairs=1,
        first_run_estimate_s=30.0,
    ),
    first_run_modes=("math",),
    first_run_estimate_s=20.0,
    notes=[
        "toy sizes: the code paths of the CUDA run without its kernels, 3 optimizer steps per generation, one "
        "model shape and one pair after the warm-up for the cost; supervised steps in fp32 without autocast (bf16 "
        "matmuls are emulated on this CPU); cost targets do not apply; budgets and the supervised steps' time wide, "
        "since the CPU mode checks the code paths, not the timing, on machines that may be busy"
    ],
)


def plan_for(device: str) -> Plan:
    return CUDA_PLAN if device == "cuda" else CPU_PLAN
