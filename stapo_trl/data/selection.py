"""Choosing the rows a run trains on: dropping overlong prompts, holding problems out, taking a subset."""

from __future__ import annotations

import logging

from datasets import Dataset

logger = logging.getLogger(__name__)


def drop_long_prompts(dataset: Dataset, tokenizer, max_prompt_tokens: int) -> Dataset:
    """The rows whose chat-templated prompt (with the generation prompt) has at most `max_prompt_tokens` tokens (verl's
    `filter_overlong_prompts`). The number dropped is logged; dropping every row is an error."""
    lengths = []
    for prompt in dataset["prompt"]:
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    keep = [index for index, length in enumerate(lengths) if length <= max_prompt_tokens]
    if not keep:
        raise ValueError(
            f"Every prompt is longer than max_prompt_tokens={max_prompt_tokens} (the shortest has {min(lengths)} "
            "tokens). Raise max_prompt_tokens."
        )
    dropped = len(dataset) - len(keep)
    if dropped:
        logger.info("Dropped %d of %d prompts longer than %d tokens.", dropped, len(dataset), max_prompt_tokens)
        return dataset.select(keep)
    return dataset


def split_heldout(dataset: Dataset, num_heldout: int, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held-out): `num_heldout` random rows are held out, and never trained on."""
    if num_heldout >= len(dataset):
        raise ValueError(
            f"Cannot hold out {num_heldout} problems from a dataset of {len(dataset)}: nothing would be left to "
            "train on. Lower heldout_problems."
        )
    shuffled = dataset.shuffle(seed=seed)
    return shuffled.select(range(num_heldout, len(shuffled))), shuffled.select(range(num_heldout))


def random_subset(dataset: Dataset, size: int, seed: int) -> Dataset:
    """`size` random rows, or the whole dataset (with a warning) when it is not larger than that."""
    if size >= len(dataset):
        if size > len(dataset):
            logger.warning("num_train_problems=%d, but only %d problems are available; using all.", size, len(dataset))
        return dataset
    return dataset.shuffle(seed=seed).select(range(size))
