"""Section 3: the S2T mask fires at the paper's thresholds, and silences exactly what `spurious_token_mask` computes.

A random model is no test of the thresholds: every token has p near 1/V, far below 0.002, and an entropy near log V,
so every token of a positive-advantage response is a candidate and the 0.8 quantile silences 80% of them. What
makes S2T fire as in the paper is a peaked distribution with a thin low-probability tail: a candidate is a sampled
token with p < 0.002, and only candidates whose entropy is below the 0.8 quantile of the candidates' entropies are
silenced. So the model first takes a few supervised steps on the arithmetic task (problem, equation, ``Answer:``
line), in fp32 weights under bf16 autocast, which concentrates its distribution on the task's characters; then STAPO
trains it at the paper's thresholds. The supervised problems are disjoint from STAPO's prompts and none repeats: a
model that has memorised its prompts samples the same completion eight times, every advantage is zero, and nothing
can be a candidate (the first H200 run: 209 steps over the 256 prompts, cross-entropy 0.05, mean entropy 0.017
nats, 0 candidates in 8 steps). Rewards: DAPO's ``Answer:`` reward plus partial credit for a near answer, so that
groups of a barely trained model still differ.

A subclass of `STAPOTrainer` keeps each optimizer step's tensors as the trainer applied the rules (p, H, the
advantages, the loss mask, the silenced tokens, the keep-mask folded into ``tool_mask`` and ``num_items_in_batch``),
and the section recomputes the mask with `spurious_token_mask` on them.
"""

from __future__ import annotations

import math
import time

import torch

from stapo_trl import STAPOTrainer, spurious_token_mask
from stapo_trl.core.names import (
    ADVANTAGES_BEFORE_RULES_KEY,
    ENTROPIES_KEY,
    LOG_PROBS_KEY,
    NUM_ITEMS_BEFORE_RULES_KEY,
    SILENCED_KEY,
)
from stapo_trl.core.token_rules import per_token_advantages

from .models import ModelFactory, answer_distance_reward, arithmetic_rows, build_tokenizer
from .training import build_trainer, config_classes, free_memory, recipe_config, scratch_dir, stapo_settings, train


class MaskRecordingTrainer(STAPOTrainer):
    """`STAPOTrainer` that keeps, for every optimizer step, the tensors its token rules read and what they set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded_steps: list[dict] = []

    def apply_token_rules(self, step_batches):
        statistics = super().apply_token_rules(step_batches)

        def joined(values):
            return torch.cat([value.detach() for value in values]).cpu()

        self.recorded_steps.append(
            {
                "log_probs": joined(batch[LOG_PROBS_KEY] for batch in step_batches),
                "entropies": joined(batch[ENTROPIES_KEY] for batch in step_batches),
                "advantages": joined(batch[ADVANTAGES_BEFORE_RULES_KEY] for batch in step_batches),
                "loss_mask": joined(self._loss_mask_before_rules(batch).bool() for batch in step_batches),
                "silenced": joined(batch[SILENCED_KEY] for batch in step_batches),
                "keep": joined(batch["tool_mask"] for batch in step_batches),
                "items_before": [float(batch[NUM_ITEMS_BEFORE_RULES_KEY]) for batch in step_batches],
                "items_after": [float(batch["num_items_in_batch"]) for batch in step_batches],
            }
        )
        return statistics


def encode_for_supervision(tokenizer, rows: dict, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), left-padded: each problem, its equation and ``Answer:`` line, then EOS."""
    texts = [prompt + worked for prompt, worked in zip(rows["prompt"], rows["worked"], strict=True)]
    encoded = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    length = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(encoded):
        input_ids[row, length - len(ids) :] = torch.tensor(ids)
        attention_mask[row, length - len(ids) :] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids.to(device), attention_mask.to(device), labels.to(device)


def supervised_steps(model, tokenizer, rows: dict, plan, clock, device: str) -> dict:
    """Train ``model`` (fp32 weights, under bf16 autocast on CUDA) on the worked solutions for ``plan.sft_steps``
    steps or ``plan.sft_seconds``, whichever ends first, with a linear warm-up over the first tenth. Each step takes
    the next ``plan.sft_batch`` rows of a seeded permutation, so no row is seen twice while there are rows left."""
    input_ids, attention_mask, labels = encode_for_supervision(tokenizer, rows, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.sft_learning_rate, weight_decay=0.0)
    warmup = max(1, plan.sft_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    order = torch.randperm(input_ids.shape[0], generator=torch.Generator().manual_seed(0))
    model.train()
    losses, started = [], time.monotonic()
    for step in range(plan.sft_steps):
        if time.monotonic() - started > plan.sft_seconds or clock.left() < 30:
            break
        first = step * plan.sft_batch % input_ids.shape[0]
        rows_now = order[first : first + plan.sft_batch].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(
                input_ids=input_ids[rows_now], attention_mask=attention_mask[rows_now], labels=labels[rows_now]
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del optimizer, schedule
    return {
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": time.monotonic() - started,
    }


def check_step(step: dict, prob_threshold: float, entropy_quantile: float, items_scale: int) -> dict:
    expected, statistics = spurious_token_mask(
        step["log_probs"],
        step["entropies"],
        step["advantages"],
        step["loss_mask"],
        prob_threshold=prob_threshold,
        entropy_quantile=entropy_quantile,
    )
    silenced = step["silenced"].bool()
    count = int(silenced.sum())
    items_expected = [before - count * items_scale for before in step["items_before"]]
    return {
        "mask_mismatches": int((expected != silenced).sum()),
        "keep_mismatches": int((step["keep"].bool() != ~silenced).sum()),
        "items_errors": sum(abs(a - b) for a, b in zip(items_expected, step["items_after"], strict=True)),
        "silenced": count,
        "candidates": statistics["num_candidates"],
        "tokens": statistics["num_tokens"],
        "tau_h": statistics["entropy_threshold"],
    }


def run(section, plan, environment: dict) -> None:
    from datasets import Dataset

    from stapo_trl.rewards import dapo_reward

    tokenizer = build_tokenizer(plan.model.vocab_size)
    factory = ModelFactory(plan.model, tokenizer, device=section.device, dtype=torch.bfloat16)
    num_prompts = max(plan.mask_run.num_prompts, 256)
    every_row = arithmetic_rows(num_prompts + plan.sft_steps * plan.sft_batch)
    rows = {key: values[:num_prompts] for key, values in every_row.items()}
    supervised_rows = {key: values[num_prompts:] for key, values in every_row.items()}
    section.note("model", {"shape": plan.model.name, "parameters": factory.num_parameters})
    section.note("supervised problems", {"distinct": len(supervised_rows["prompt"]), "shared_with_stapo": 0})

    section.clock.require(40, "the supervised steps and two STAPO generations")
    student = factory.build().float()
    supervised = supervised_steps(student, tokenizer, supervised_rows, plan, section.clock, section.device)
    weights = {name: value.detach().to(torch.bfloat16) for name, value in student.state_dict().items()}
    del student
    free_memory()
    section.record(
        "supervised steps before STAPO",
        supervised["steps"],
        "steps",
        "",
        None,
        f"cross-entropy {supervised['first_loss']:.2f} -> {supervised['last_loss']:.2f} nats per token "
        f"(log V = {math.log(len(tokenizer)):.2f}), {supervised['seconds']:.1f} s, batch {plan.sft_batch}, "
        f"lr {plan.sft_learning_rate}",
    )

    dataset = Dataset.from_dict({"prompt": rows["prompt"], "solution": rows["solution"]})
    config = recipe_config(
        config_classes("stapo"),
        plan,
        scratch_dir(),
        max_steps=plan.mask_steps,
        learning_rate=plan.recipe_learning_rate,
        run=plan.mask_run,
        **stapo_settings(plan, environment),
    )
    model = factory.build(weights)
    trainer = build_trainer(
        "stapo",
        model,
        tokenizer,
        dataset,
        [dapo_reward, answer_distance_reward],
        config,
        trainer_class=MaskRecordingTrainer,
    )
    result = train(trainer, "stapo", section.clock, section.device)
    recorded = trainer.recorded_steps
    items_scale = config.steps_per_generation // config.gradient_accumulation_steps
    section.note("statistics backend", trainer.token_stats.backend)
    del trainer, model
    free_memory()
    report(section, plan, recorded, items_scale, result)


def report(section, plan, recorded: list[dict], items_scale: int, result) -> None:
    if not recorded:
        section.skip("S2T mask against spurious_token_mask", "no optimizer step ran before the section's deadline")
        return
    checks = [check_step(step, plan.prob_threshold, plan.entropy_quantile, items_scale) for step in recorded]
    steps_note = f"{len(recorded)} optimizer steps" + (
        " (stopped at the section's deadline)" if result.cut_short else ""
    )
    section.record(
        "silenced tokens that differ from spurious_token_mask on the same p, H, A",
        sum(check["mask_mismatches"] for check in checks),
        "tokens",
        "0",
        all(check["mask_mismatches"] == 0 for check in checks),
        steps_note,
    )
    section.record(
        "keep-mask in tool_mask against the silenced tokens",
        sum(check["keep_mismatches"] for check in checks),
        "tokens",
        "0",
        all(check["keep_mismatches"] == 0 for check in checks),
    )
    section.record(
        "num_items_in_batch less the silenced tokens",
        sum(check["items_errors"] for check in checks),
        "",
        "0 (error of the renormalising count)",
        all(check["items_errors"] == 0 for check in checks),
    )
    silenced = sum(check["silenced"] for check in checks)
    tokens = sum(check["tokens"] for check in checks)
    candidates = sum(check["candidates"] for check in checks)
    fired_steps = sum(check["silenced"] > 0 for check in checks)
    section.record(
        f"tokens silenced at prob_threshold {plan.prob_threshold}, entropy_quantile {plan.entropy_quantile}",
        silenced,
        "tokens",
        "> 0: the mask fires",
        silenced > 0,
        f"in {fired_steps} of {len(checks)} steps; {candidates} candidates; {silenced / max(tokens, 1):.4%} of "
        f"{tokens} loss tokens (the paper: mostly under 0.01% on real rollouts)",
    )
    section.note(
        "per step",
        [{key: check[key] for key in ("tokens", "candidates", "silenced", "tau_h")} for check in checks],
    )
    loss_tokens = torch.cat([step["loss_mask"].flatten() for step in recorded])
    log_probs = torch.cat([step["log_probs"].flatten() for step in recorded])[loss_tokens]
    entropies = torch.cat([step["entropies"].flatten() for step in recorded])[loss_tokens]
    positive = torch.cat(
        [per_token_advantages(step["advantages"], step["loss_mask"]).gt(0).flatten() for step in recorded]
    )[loss_tokens]
    section.record(
        "loss tokens in responses with positive advantage",
        float(positive.double().mean()),
        "",
        "",
        None,
        "candidates can only be found there; 0 when every group's completions score alike",
    )
    section.record(
        "loss tokens with p below prob_threshold",
        float((log_probs < math.log(plan.prob_threshold)).double().mean()),
        "",
        "",
        None,
        f"mean entropy {float(entropies.mean()):.3f} nats, median p {float(log_probs.exp().median()):.3f}",
    )
