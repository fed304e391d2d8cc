"""Greedy-decoding accuracy of a model on a few held-out problems, scored with a training reward function."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from .scoring import accepts, reward_verdicts


@dataclass
class GreedyAccuracy:
    """The share of problems whose greedy completion the reward scores positive. `answered` counts completions from
    which the reward extracted an answer, when it reports extractions through TRL's `log_extra` (else None)."""

    correct: int
    total: int
    answered: int | None = None
    completions: list[str] = field(default_factory=list, repr=False)
    problem_correct: list[bool] = field(default_factory=list, repr=False)  # per problem, in the dataset's order
    problem_answered: list[bool | None] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    @property
    def standard_error(self) -> float:
        """Binomial standard error of `accuracy` over the draw of problems."""
        p = self.accuracy
        return math.sqrt(p * (1 - p) / self.total) if self.total else float("nan")

    @property
    def format_rate(self) -> float | None:
        return None if self.answered is None or not self.total else self.answered / self.total

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ("accuracy", "standard_error", "correct", "total", "format_rate")}

    def __str__(self) -> str:
        text = f"{self.accuracy:.3f} ± {self.standard_error:.3f} ({self.correct}/{self.total})"
        if self.format_rate is not None:
            text += f", answer format {self.format_rate:.2f}"
        return text


def render_prompt(tokenizer, messages: list[dict], chat_template: bool = True) -> tuple[int, ...]:
    """The prompt's token ids: the chat template with the generation prompt, or the plain message text."""
    if chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tuple(tokenizer("\n\n".join(message["content"] for message in messages))["input_ids"])


@torch.no_grad()
def greedy_accuracy(
    model,
    tokenizer,
    dataset,
    reward_func: Callable,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    description: str = "greedy eval",
    show_progress: bool = True,
    share_prompt_prefix: bool = True,
) -> GreedyAccuracy:
    """Greedy-decode every prompt of `dataset` (TRL's `prompt` and `solution` columns), chat-formatted and left-padded
    in batches of ``batch_size``, in eval mode (the model's mode is restored afterwards), and score it. With
    ``share_prompt_prefix``, a batch's shared leading tokens run once (`prompt_prefix_cache`): the same result as
    running each prompt whole, up to floating-point rounding (which can flip a near-tie between two tokens)."""
    if len(dataset) == 0:
        raise ValueError("The held-out set is empty.")
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    completions: list[str] = []
    try:
        batches = range(0, len(dataset), batch_size)
        for start in tqdm(batches, desc=description, disable=not show_progress, unit="batch"):
            token_ids = [
                list(render_prompt(tokenizer, prompt)) for prompt in dataset[start : start + batch_size]["prompt"]
            ]
            inputs = prompt_prefix_cache(model, token_ids, pad_token_id, device) if share_prompt_prefix else None
            if inputs is None:
                inputs = tokenizer.pad({"input_ids": token_ids}, padding=True, return_tensors="pt").to(device)
            output = model.generate(
                **inputs, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id
            )
            completions += tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    scores, extracted = reward_verdicts(reward_func, completions, dataset["solution"])
    problem_correct = [accepts(score) for score in scores]
    problem_answered = [None] * len(completions) if extracted is None else [value is not None for value in extracted]
    answered = None if extracted is None else sum(problem_answered)
    return GreedyAccuracy(
        sum(problem_correct), len(completions), answered, completions, problem_correct, problem_answered
    )


MIN_SHARED_PREFIX_TOKENS = 16  # below this many shared tokens, `prompt_prefix_cache` leaves the batch to run whole


def shared_prefix_length(token_ids: list[list[int]]) -> int:
    """How many leading tokens all rows of ``token_ids`` share, leaving at least one token of each row."""
    shortest = min(len(row) for row in token_ids)
    length = 0
    while length < shortest - 1 and all(row[length] == token_ids[0][length] for row in token_ids):
        length += 1
    return length


def prompt_prefix_cache(model, token_ids: list[list[int]], pad_token_id: int, device) -> dict[str, Any] | None:
    """`generate()` inputs (``input_ids``, ``attention_mask``, the cache) that run the shared leading tokens of
    ``token_ids`` once: the prefix's cache is copied to every row, laid out as ``[prefix][padding][remainder]`` with
    the padding out of the attention mask, so remainder tokens keep their positions (`generate()` derives them from
    the mask). None for one row, under `MIN_SHARED_PREFIX_TOKENS` shared tokens, or a cache it cannot copy."""
    if len(token_ids) < 2:
        return None
    shared = shared_prefix_length(token_ids)
    if shared < MIN_SHARED_PREFIX_TOKENS:
        return None
    prefix = torch.tensor([token_ids[0][:shared]], device=device)
    output = model(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True)
    cache_name = "cache" if "cache" in output else "past_key_values"  # transformers' name for it before 5.2x
    cache = output.get(cache_name)
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "batch_repeat_interleave") for layer in layers):
        return None
    for layer in layers:
        layer.batch_repeat_interleave(len(token_ids))
    width = max(len(row) for row in token_ids)
    input_ids = [[*row[:shared], *[pad_token_id] * (width - len(row)), *row[shared:]] for row in token_ids]
    attention_mask = [[1] * shared + [0] * (width - len(row)) + [1] * (len(row) - shared) for row in token_ids]
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    return {key: torch.tensor(value, device=device) for key, value in inputs.items()} | {cache_name: cache}


def per_problem_records(dataset, results: dict[str, GreedyAccuracy]) -> list[dict[str, Any]]:
    """One record per problem with each labelled result's (``{"before": ...}``) correct, answered and completion."""
    records = []
    for index in range(len(dataset)):
        record: dict[str, Any] = {"problem": index, "solution": dataset[index]["solution"]}
        for label, result in results.items():
            record[f"{label}_correct"] = result.problem_correct[index]
            record[f"{label}_answered"] = result.problem_answered[index]
            record[f"{label}_completion"] = result.completions[index]
        records.append(record)
    return records
