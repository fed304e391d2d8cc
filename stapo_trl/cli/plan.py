"""The batch arithmetic of a run at a given world size, and the plan that `stapo-trl train --dry_run` prints."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..gguf import is_gguf_reference
from ..methods import describe_token_rule, method_preset


@dataclass(frozen=True)
class BatchPlan:
    """How completions flow through one generation (used `num_iterations` times) and its optimizer steps, all ranks."""

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_generations: int
    num_iterations: int

    @property
    def completions_per_step(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps

    @property
    def completions_per_generation(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.steps_per_generation

    @property
    def prompts_per_generation(self) -> int:
        return self.completions_per_generation // self.num_generations

    @property
    def prompts_per_step(self) -> Fraction:
        return Fraction(self.completions_per_step, self.num_generations)

    @property
    def optimizer_steps_per_generation(self) -> Fraction:
        """A fraction, which the plan flags (`stapo_trl.core.config.optimizer_steps_per_generation` rounds down)."""
        return Fraction(self.steps_per_generation * self.num_iterations, self.gradient_accumulation_steps)


def batch_plan(config: Any, world_size: int, *, generation_batch_size_given: bool) -> BatchPlan:
    """The `BatchPlan` of a `GRPOConfig` run on `world_size` processes (maybe not the size `config` was built at):
    `steps_per_generation` is recomputed from a `generation_batch_size` the recipe gave. Raises `ValueError` when the
    sizes do not divide, naming the values to change."""
    if world_size < 1:
        raise ValueError(f"The world size must be at least 1 process, got {world_size}.")
    per_device = config.per_device_train_batch_size
    global_micro_batch = per_device * world_size
    if generation_batch_size_given:
        generation_batch_size = config.generation_batch_size
        if generation_batch_size % global_micro_batch != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be divisible by per_device_train_batch_size "
                f"x world size ({per_device} x {world_size} = {global_micro_batch}). Change generation_batch_size, "
                "or set steps_per_generation instead."
            )
        steps_per_generation = generation_batch_size // global_micro_batch
    else:
        steps_per_generation = config.steps_per_generation
    plan = BatchPlan(
        world_size=world_size,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_generations=config.num_generations,
        num_iterations=config.num_iterations,
    )
    if plan.completions_per_generation % plan.num_generations != 0:
        raise ValueError(
            f"The completions per generation, per_device_train_batch_size x world size x steps_per_generation = "
            f"{per_device} x {world_size} x {steps_per_generation} = {plan.completions_per_generation}, must be "
            f"divisible by num_generations ({plan.num_generations}), so that every prompt's completions are "
            "generated together. Change one of these."
        )
    rules = [*getattr(config, "active_token_rules", []), *getattr(config, "shadow_token_rules", [])]
    if rules and steps_per_generation % plan.gradient_accumulation_steps != 0:
        raise ValueError(
            f"With token rules on ({', '.join(rules)}), steps_per_generation ({steps_per_generation} at {world_size} "
            f"processes) must be a multiple of gradient_accumulation_steps ({plan.gradient_accumulation_steps}): the "
            "rules run once per optimizer step over all of its micro-batches, so a step's micro-batches must come "
            "from one generation."
        )
    return plan


def _number(value: Fraction | int) -> str:
    if isinstance(value, Fraction) and value.denominator != 1:
        return f"{value} (= {float(value):.3g}; not a whole number)"
    return str(int(value))


def describe_model(model_args: Any, training: Any, script: Any) -> str:
    name = model_args.model_name_or_path or "(none: set model_name_or_path)"
    details = [f"dtype {model_args.dtype or 'auto'}"]
    dropout_off = getattr(training, "disable_dropout", False)
    if is_gguf_reference(name):
        details.insert(0, "GGUF, converted once to a cached safetensors checkpoint")
    if model_args.use_peft:
        targets = ",".join(model_args.lora_target_modules or ["PEFT defaults"])
        where = f" of the last {script.lora_layers} layers" if script.lora_layers else ""
        dropout = 0.0 if dropout_off else getattr(model_args, "lora_dropout", 0.0)
        lora = f"LoRA r={model_args.lora_r} alpha={model_args.lora_alpha}"
        details.append(f"{lora} dropout {dropout:g} on {targets}{where}")
    else:
        details.append("full fine-tuning")
    if dropout_off:
        details.append("dropout off (disable_dropout)")
    if training.gradient_checkpointing:
        details.append("gradient checkpointing")
    return f"{name} ({', '.join(details)})"


def describe_frozen_layer_replay(training: Any, script: Any, world_size: int) -> str:
    """Where the CPU loss pass gets the frozen layers' states from: `generate()`, TRL's old-log-prob pass, or nowhere."""
    if not script.replay_frozen_layers:
        return "every layer in the loss"
    if world_size > 1:
        return "every layer in the loss: the frozen-layer replay is off with several processes"
    if not training.use_vllm:
        return "frozen layers replayed from generate()"
    generate_every = training.steps_per_generation * training.num_iterations
    if training.gradient_accumulation_steps % generate_every or training.vllm_importance_sampling_correction:
        return "frozen layers replayed from TRL's old-log-prob pass"
    return (
        "every layer in the loss: vLLM samples and TRL runs no old-log-prob pass, so nothing records the frozen layers"
    )


def format_plan(request: Any) -> str:
    """The dry-run plan: method, model, data, rewards, token rule, loss, generation, world size and batch arithmetic."""
    script, training, plan = request.script, request.training, request.plan
    preset = method_preset(script.method)
    data = f"{script.dataset_name} (split {script.dataset_train_split}, prompt style {script.prompt_style}"
    if script.max_prompt_tokens:
        data += f", prompts over {script.max_prompt_tokens} tokens dropped"
    if script.num_train_problems:
        data += f", {script.num_train_problems} problems"
    if script.heldout_problems:
        data += f", {script.heldout_problems} held out for greedy accuracy before and after"
    warmup = training.warmup_steps
    warmup_text = f", {int(warmup) if warmup >= 1 else warmup} warm-up steps" if warmup else ""
    scheduler = getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)
    delta = f", dual-clip delta {training.delta}" if training.delta is not None else ""
    loss = (
        f"{training.loss_type}, epsilon {training.epsilon}/{training.epsilon_high}, beta {training.beta}{delta}, lr "
        f"{training.learning_rate:g} {scheduler}{warmup_text}, grad clip {training.max_grad_norm}, weight decay "
        f"{training.weight_decay}"
    )
    on_cpu = training.use_cpu and not request.cpu_stand_in
    engine = f"vLLM {training.vllm_mode}" if training.use_vllm else "transformers generate"
    if engine == "vLLM colocate" and on_cpu:
        engine += " on the CPU (stapo-trl's CPU adapter: one engine per process, the policy's dtype, KV cache 1 GiB)"
    elif engine == "vLLM colocate":
        engine += f" (tensor parallel {training.vllm_tensor_parallel_size}, gpu memory "
        engine += f"{training.vllm_gpu_memory_utilization})"
    precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
    if on_cpu:
        head = "stapo-trl's CPU LM head" if script.cpu_lm_head else "TRL's torch fallback of its fused LM head"
        precision += f", CPU ({head}; {describe_frozen_layer_replay(training, script, plan.world_size)})"
    rewards = ", ".join(script.reward_funcs)
    if script.reward_model_name_or_path:
        rewards += f", reward model {script.reward_model_name_or_path}"
    per_device, world = plan.per_device_train_batch_size, plan.world_size
    epochs = training.num_train_epochs
    iterations = f" (num_iterations {plan.num_iterations})" if plan.num_iterations != 1 else ""
    rows = {
        "recipe": str(request.recipe_path) if request.recipe_path else "(command line only)",
        "method": f"{preset.name}: {preset.summary}",
        "model": describe_model(request.model, training, script),
        "dataset": data + ")",
        "rewards": rewards,
        "token rule": describe_token_rule(training),
        "loss": loss,
        "generation": f"{engine}, temperature {training.temperature}, top_p {training.top_p}, max completion "
        f"{training.max_completion_length} tokens",
        "precision": precision,
        "world size": f"{world} ({request.world_size_source})",
        "launch": "accelerate launch " + " ".join(request.launch_args) if request.launch_args else "this process",
        "per step": f"{per_device} per device x {world} processes x {plan.gradient_accumulation_steps} accumulation = "
        f"{plan.completions_per_step} completions per optimizer step ({_number(plan.prompts_per_step)} prompts x "
        f"{plan.num_generations})",
        "per generation": f"{per_device} x {world} x {plan.steps_per_generation} micro-batches = "
        f"{plan.completions_per_generation} completions per generation ({plan.prompts_per_generation} prompts x "
        f"{plan.num_generations})",
        "steps/generation": f"{_number(plan.optimizer_steps_per_generation)} optimizer steps per generation{iterations}",
        "stop after": f"{training.max_steps} optimizer steps" if training.max_steps > 0 else f"{epochs} epochs",
        "output": f"{training.output_dir} (report_to {', '.join(training.report_to) or 'none'})",
    }
    width = max(map(len, rows))
    lines = ["stapo-trl train: dry run, nothing loaded"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows.items()]
    lines += [f"  note: {note}" for note in request.notes]
    return "\n".join(lines)
