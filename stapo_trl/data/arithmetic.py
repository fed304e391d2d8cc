"""A built-in generator of arithmetic word problems, for the offline CPU quickstart.

Each problem is one addition, subtraction or multiplication of small whole numbers, told as a short story: easy
enough that SmolLM2-135M-Instruct gets about a quarter right with greedy decoding before training, so that RL has a
signal to work with (with two-step problems and numbers up to 50 it got under a tenth, and most groups of samples
scored all -1). Rows have the same columns as DAPO-Math-17K (`stapo_trl.data.ROW_FEATURES`), so every prompt style
and reward of the project applies. Training and held-out problems come from disjoint streams: `split="train"` and
`split="heldout"` never produce the same problem text for the same seed.

`num_fewshot` puts worked examples (`WORKED_EXAMPLES`) before the problem as earlier chat turns. A 135M model sampled
at temperature 1.0 rarely keeps to an instruction alone; shown two worked examples, it keeps to their form often
enough that groups of samples mix right and wrong answers, which is what gives GRPO and the S2T mask something to act
on at the paper's temperature.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from operator import add, mul, sub

from datasets import Dataset

from .prompts import PROMPT_STYLES, answer_line, build_prompt
from .sources import ROW_FEATURES, dataset_row

ARITHMETIC = "arithmetic"
"""Pass `dataset_name: arithmetic` in a recipe to train on generated problems."""

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
"""(problem, worked solution, answer) shown by `num_fewshot`. Their names (Tom, Sara, Max) are not in `NAMES`, so a
worked example is never a training or held-out problem."""


def arithmetic_problems(num_problems: int, *, seed: int = 0, split: str = "train") -> list[tuple[str, int]]:
    """`num_problems` distinct (problem, answer) pairs; the same arguments always give the same list."""
    if split not in SPLITS:
        raise ValueError(f"Unknown arithmetic split {split!r}; choose one of {SPLITS}.")
    if num_problems < 1:
        raise ValueError(f"num_problems must be at least 1, got {num_problems}.")
    rng = random.Random(f"stapo-trl-arithmetic-{seed}")
    problems: list[tuple[str, int]] = []
    seen: set[str] = set()
    target = {"train": 0, "heldout": 1}[split]
    attempts = 0
    while len(problems) < num_problems:
        attempts += 1
        if attempts > 200 * num_problems + 10_000:
            raise ValueError(f"Could not generate {num_problems} distinct arithmetic problems; ask for fewer.")
        text, a_range, b_range, operation = rng.choice(TEMPLATES)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        question, answer = text.format(name=name, item=item, a=a, b=b), operation(a, b)
        # One stream, split by a hash of the text: train and held-out problems can never coincide.
        if hash_bucket(question) != target or question in seen:
            continue
        seen.add(question)
        problems.append((question, answer))
    return problems


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


def _template_pattern(template: str) -> re.Pattern:
    parts, seen = [], set()
    for piece in re.split(r"(\{\w+\})", template):
        name = piece[1:-1] if piece.startswith("{") else None
        if name is None:
            parts.append(re.escape(piece))
        elif name in seen:
            parts.append(f"(?P={name})")
        else:
            seen.add(name)
            parts.append(f"(?P<{name}>{PLACEHOLDERS[name]})")
    return re.compile("".join(parts))


def worked_solution(question: str) -> tuple[str, int] | None:
    """``(solution, answer)`` of a problem `arithmetic_problems` wrote, the solution in the form the worked examples
    show (``"3 + 2 = 5"``); None for any other text."""
    for template, _, _, operation in TEMPLATES:
        match = _template_pattern(template).fullmatch(question)
        if match:
            a, b = int(match["a"]), int(match["b"])
            answer = operation(a, b)
            return f"{a} {SYMBOLS[operation]} {b} = {answer}", answer
    return None


def fewshot_prompt(question: str, num_fewshot: int, prompt_style: str, system_prompt: str | None) -> list[dict]:
    """The chat prompt of `question` after `num_fewshot` worked examples as earlier user and assistant turns.

    The user turns hold the bare problems: the examples show the answer format, so the style's instruction wrapper
    (DAPO's two sentences around every problem) is left out, which keeps the prompt short.
    """
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
    """Generated arithmetic word problems as TRL-ready rows, in the columns of `load_dapo_math`.

    With `num_fewshot` > 0, each prompt is `fewshot_prompt`: that many worked examples, then the bare problem.
    """
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"Unknown prompt_style {prompt_style!r}; choose one of {PROMPT_STYLES}.")
    if not 0 <= num_fewshot <= len(WORKED_EXAMPLES):
        raise ValueError(f"num_fewshot must be between 0 and {len(WORKED_EXAMPLES)}, got {num_fewshot}.")
    problems = arithmetic_problems(num_problems, seed=seed, split=split)
    if num_fewshot:
        prompts = [fewshot_prompt(question, num_fewshot, prompt_style, system_prompt) for question, _ in problems]
    else:
        prompts = [build_prompt(question, prompt_style, system_prompt) for question, _ in problems]
    rows = [
        dataset_row(f"arithmetic-{split}-{seed}-{index}", question, str(answer), prompt, ARITHMETIC)
        for index, ((question, answer), prompt) in enumerate(zip(problems, prompts, strict=True))
    ]
    return Dataset.from_list(rows, features=ROW_FEATURES)
