"""Arithmetic word problems for the offline CPU quickstart: one addition, subtraction or multiplication of small whole
numbers as a short story, in the columns of DAPO-Math-17K. `split="train"` and `split="heldout"` never share a
problem; `num_fewshot` worked examples as earlier chat turns keep a 135M model at T=1.0 to the answer format."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from operator import add, mul, sub

from datasets import Dataset

from .prompts import answer_line, build_prompt, check_prompt_style
from .sources import ROW_FEATURES, dataset_row

ARITHMETIC = "arithmetic"  # `dataset_name: arithmetic` in a recipe trains on generated problems

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo", "Mia", "Noah")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards", "stamps", "cookies")
SPLITS = ("train", "heldout")

TEMPLATES: tuple[tuple[str, tuple[int, int], tuple[int, int], Callable[[int, int], int]], ...] = (
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", (2, 12), (2, 9), add),
    ("{name} had {a} {item} and gave away {b}. How many {item} does {name} have left?", (6, 15), (1, 5), sub),
    ("{name} has {a} boxes with {b} {item} in each box. How many {item} is that in total?", (2, 5), (2, 5), mul),
)
"""(problem template, range of a, range of b, how the answer follows from a and b) for each kind of problem."""

WORKED_EXAMPLES: tuple[tuple[str, str, int], ...] = (
    ("Tom has 3 apples and gets 2 more. How many apples does Tom have now?", "3 + 2 = 5", 5),
    ("Sara has 4 boxes with 3 pens in each box. How many pens is that in total?", "4 * 3 = 12", 12),
    ("Max had 9 coins and gave away 4. How many coins does Max have left?", "9 - 4 = 5", 5),
)
"""(problem, worked solution, answer) shown by `num_fewshot`; their names are not in `NAMES`, so none is a problem."""


def arithmetic_problems(num_problems: int, *, seed: int = 0, split: str = "train") -> list[tuple[str, int]]:
    """`num_problems` distinct (problem, answer) pairs; the same arguments always give the same list."""
    if split not in SPLITS:
        raise ValueError(f"Unknown arithmetic split {split!r}; choose one of {SPLITS}.")
    if num_problems < 1:
        raise ValueError(f"num_problems must be at least 1, got {num_problems}.")
    rng = random.Random(f"stapo-trl-arithmetic-{seed}")
    problems: dict[str, int] = {}
    for _ in range(200 * num_problems + 10_000):
        text, a_range, b_range, operation = rng.choice(TEMPLATES)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        question = text.format(name=name, item=item, a=a, b=b)
        # One stream, split by a hash of the text: train and held-out problems can never coincide.
        if hash_bucket(question) == SPLITS.index(split):
            problems.setdefault(question, operation(a, b))
            if len(problems) == num_problems:
                return list(problems.items())
    raise ValueError(f"Could not generate {num_problems} distinct arithmetic problems; ask for fewer.")


def hash_bucket(text: str) -> int:
    """0 for training problems, 1 for held-out ones: a stable hash, one problem in five held out."""
    value = 0
    for character in text.encode():
        value = (value * 131 + character) % 1_000_003
    return int(value % 5 == 0)


def worked_answer(solution: str, answer: int, prompt_style: str) -> str:
    """A worked solution ending in the answer format of `prompt_style`: an `Answer:` line (dapo) or `\\boxed{}`."""
    separator = " " if prompt_style == "boxed" else "\n"
    return f"{solution}{separator}{answer_line(str(answer), prompt_style)}"


SYMBOLS = {add: "+", sub: "-", mul: "*"}
PLACEHOLDERS = {"name": r"[A-Z][a-z]+", "item": r"[a-z]+", "a": r"\d+", "b": r"\d+"}


def worked_solution(question: str) -> tuple[str, int] | None:
    """``(solution, answer)`` of a problem `arithmetic_problems` wrote (solution as ``"3 + 2 = 5"``), else None."""
    for template, _, _, operation in TEMPLATES:
        pattern = re.escape(template)  # a placeholder's later occurrences repeat its first
        for name, part in PLACEHOLDERS.items():
            placeholder = re.escape(f"{{{name}}}")
            pattern = pattern.replace(placeholder, f"(?P<{name}>{part})", 1).replace(placeholder, f"(?P={name})")
        if match := re.fullmatch(pattern, question):
            a, b = int(match["a"]), int(match["b"])
            answer = operation(a, b)
            return f"{a} {SYMBOLS[operation]} {b} = {answer}", answer
    return None


def fewshot_prompt(question: str, num_fewshot: int, prompt_style: str, system_prompt: str | None) -> list[dict]:
    """The chat prompt of `question` after `num_fewshot` worked examples as earlier user and assistant turns. The user
    turns hold the bare problems, without the style's instruction: the examples show the answer format."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for example, solution, answer in WORKED_EXAMPLES[:num_fewshot]:
        messages.append({"role": "user", "content": example})
        messages.append({"role": "assistant", "content": worked_answer(solution, answer, prompt_style)})
    messages.append({"role": "user", "content": question})
    return messages


def load_arithmetic(
    num_problems: int,
    *,
    seed: int = 0,
    split: str = "train",
    prompt_style: str = "dapo",
    system_prompt: str | None = None,
    num_fewshot: int = 0,
) -> Dataset:
    """Generated problems as TRL rows (`ROW_FEATURES`); `num_fewshot` > 0 makes each prompt a `fewshot_prompt`."""
    check_prompt_style(prompt_style)
    if not 0 <= num_fewshot <= len(WORKED_EXAMPLES):
        raise ValueError(f"num_fewshot must be between 0 and {len(WORKED_EXAMPLES)}, got {num_fewshot}.")
    rows = []
    for index, (question, answer) in enumerate(arithmetic_problems(num_problems, seed=seed, split=split)):
        if num_fewshot:
            prompt = fewshot_prompt(question, num_fewshot, prompt_style, system_prompt)
        else:
            prompt = build_prompt(question, prompt_style, system_prompt)
        rows.append(dataset_row(f"arithmetic-{split}-{seed}-{index}", question, str(answer), prompt, ARITHMETIC))
    return Dataset.from_list(rows, features=ROW_FEATURES)
