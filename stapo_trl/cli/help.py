"""`stapo-trl train -h`: the options people change, grouped, on one screen. `--help-all` prints every option."""

from __future__ import annotations

from ..methods import METHOD_NAMES

HELP_ALL_FLAG = "--help-all"

GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "recipe and run",
        (
            ("config", "a YAML recipe; flags on the command line override its keys"),
            ("method", f"{' | '.join(METHOD_NAMES)}: sets that method's defaults"),
            ("dry_run", "print the resolved plan (batch sizes, launch) and exit without loading anything"),
            ("output_dir", "where checkpoints, metrics.jsonl, the model card and run_summary.json go"),
            ("overwrite_output_dir", "start afresh in an output_dir that holds an earlier run (it is deleted)"),
            ("resume_from_checkpoint", "'last' (the newest complete checkpoint of output_dir) or a checkpoint-N dir"),
            ("max_steps", "optimizer steps to train"),
            ("seed", "random seed of data order, sampling and initialization"),
        ),
    ),
    (
        "model",
        (
            ("model_name_or_path", "a Hub id, a saved model directory, or a .gguf file"),
            ("dtype", "float32, bfloat16 or float16"),
            ("use_peft", "train a LoRA adapter instead of the full model"),
            ("lora_r", "LoRA rank"),
            ("lora_layers", "with use_peft: adapt only the last this many layers"),
            ("cpu_lm_head", "on the CPU, stapo-trl's fast path for TRL's fused LM head (default true)"),
            ("replay_frozen_layers", "on the CPU, reuse generate()'s frozen-layer states in the loss (default true)"),
        ),
    ),
    (
        "data and rewards",
        (
            ("dataset_name", "DAPO-Math-17K (Hub id or local file), 'sample', or 'arithmetic'"),
            ("prompt_style", "boxed (answer in \\boxed{}) or dapo (an 'Answer:' line)"),
            ("reward_funcs", "registered rewards (boxed, dapo, math_verify, ...) or dotted import paths"),
            ("num_train_problems", "train on this many problems"),
            ("heldout_problems", "score this many held-out problems greedily before and after training"),
        ),
    ),
    (
        "S2T mask (STAPO)",
        (
            ("use_s2t_mask", "silence spurious tokens and renormalize the loss over the kept ones"),
            ("prob_threshold", "tau_p: candidates have p below this (paper: 0.002)"),
            ("entropy_quantile", "tau_h is this quantile of the candidates' entropies (paper: 0.8)"),
            ("token_stats_source", "generation (the sampling policy) or loss (the policy being optimized)"),
            ("dump_silenced_tokens", "write every silenced token, in context, to silenced_tokens.jsonl"),
        ),
    ),
    (
        "batch and optimization",
        (
            ("per_device_train_batch_size", "completions per device per micro-batch"),
            ("num_generations", "completions per prompt (the group)"),
            ("gradient_accumulation_steps", "micro-batches per optimizer step"),
            ("steps_per_generation", "micro-batches per generation (a multiple of gradient_accumulation_steps)"),
            ("learning_rate", "peak learning rate"),
            ("loss_type", "dapo (the paper's), grpo, bnpo, dr_grpo, ..."),
        ),
    ),
    (
        "generation",
        (
            ("temperature", "sampling temperature; p and H are taken under it"),
            ("max_completion_length", "tokens per completion"),
            ("use_vllm", "generate with vLLM (GPU)"),
            ("vllm_mode", "colocate or server"),
        ),
    ),
    (
        "launch and logging",
        (
            ("num_processes", "processes to launch with accelerate (one per GPU)"),
            ("accelerate_config", "an accelerate config file, or a shipped name such as zero3"),
            ("report_to", "none, wandb, tensorboard, ..."),
            ("push_to_hub", "upload the model and its card to the Hub"),
        ),
    ),
)
"""(group title, ((option, one-line description), ...)). A test checks that every option exists."""

WIDTH = 30


def short_help() -> str:
    lines = [
        "usage: stapo-trl train --config RECIPE.yaml [--option value ...]",
        "",
        "Train with a YAML recipe; any key of the recipe can also be given as --key value. The options people",
        "change most are below; `stapo-trl train --help-all` lists all of them, with TRL's and transformers' own.",
        "`--debug` prints the traceback of an error as well as its message.",
    ]
    for title, options in GROUPS:
        lines += ["", f"{title}:"]
        lines += [f"  --{name:<{WIDTH}} {text}" for name, text in options]
    lines += [
        "",
        "examples:",
        "  stapo-trl train --config recipes/quickstart/smollm2-135m-cpu.yaml",
        "  stapo-trl train --config recipes/dapo_math_17k/qwen3-8b-base/stapo.yaml --dry_run",
        "  stapo-trl train --config RECIPE.yaml --method grpo --seed 1 --output_dir outputs/grpo-seed1",
    ]
    return "\n".join(lines)
