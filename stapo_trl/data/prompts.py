"""Prompt styles for math RL: DAPO's `Answer:` instruction and the `\\boxed{}` instruction of STAPO and JustRL."""

from __future__ import annotations

import re

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
"""DAPO-Math-17K wraps every problem as DAPO_PREFIX + problem + DAPO_SUFFIX."""

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction appended to the bare problem in the `boxed` style, as in STAPO's and JustRL's training prompts."""

PROMPT_STYLES = ("dapo", "boxed")

_DAPO_PREFIX_PATTERN = re.compile(
    r"^\s*Solve the following math problem step by step\..*?where \$Answer is the answer to the problem\.\s*",
    re.DOTALL,
)
_DAPO_SUFFIX_PATTERN = re.compile(r'\s*Remember to put your answer on its own line after "Answer:"\.?\s*$')


def check_prompt_style(style: str) -> None:
    """Raise a ValueError naming `PROMPT_STYLES` when `style` is none of them."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"Unknown prompt_style {style!r}; choose one of {PROMPT_STYLES}.")


def extract_problem(text: str) -> str:
    """The bare problem inside a DAPO-wrapped prompt; text without the wrapper is returned stripped."""
    text = _DAPO_PREFIX_PATTERN.sub("", text, count=1)
    return _DAPO_SUFFIX_PATTERN.sub("", text, count=1).strip()


def answer_line(answer: str, style: str) -> str:
    """The final answer as ``style`` asks for it: ``Answer: 42`` (dapo) or ``The answer is \\boxed{42}.`` (boxed)."""
    check_prompt_style(style)
    return f"The answer is \\boxed{{{answer}}}." if style == "boxed" else f"Answer: {answer}"


def build_prompt(
    problem: str, style: str, system_prompt: str | None = None, original: str | None = None
) -> list[dict]:
    """TRL's conversational prompt: an optional system message and the user turn for `problem`. `dapo` keeps `original`
    when it already wraps the problem in DAPO's instruction, else wraps it; `boxed` appends `BOXED_INSTRUCTION`."""
    check_prompt_style(style)
    if style == "boxed":
        user = f"{problem}\n\n{BOXED_INSTRUCTION}"
    else:
        wrapped = original and _DAPO_PREFIX_PATTERN.search(original) and _DAPO_SUFFIX_PATTERN.search(original)
        user = original if wrapped else f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": user}]
