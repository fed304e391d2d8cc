"""Answer extraction and normalization for the exact-match rewards. `normalize_final_answer` is Minerva's (Lewkowycz
et al., 2022, arXiv 2206.14858, appendix D) as DAPO's verifier uses it (arXiv 2503.14476, veRL's `math_dapo`), quirks
included: a trailing period is kept, `\\dfrac` is not `\\frac`, and a comma inside a negative number stays."""

from __future__ import annotations

import re

ANSWER_LINE_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    *(("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text")),
    *((",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")),
)

_REMOVED_EXPRESSIONS: tuple[str, ...] = (  # removed in this order, as in DAPO's verifier
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units"),
    "\\ldots",
    *("sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm"),
    *("gm", "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples"),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}"),
    *("^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"),
)

_FIRST_INLINE_MATH = re.compile(r".*?\$(.*?)\$.*")
_UNWRAP_COMMANDS = tuple(re.compile(rf"\\{name}\{{(.*?)\}}") for name in ("text", "textbf", "overline"))
_UNWRAP_BOXED = re.compile(r"\\boxed\{(.*)\}")
_SHORT_FRAC = re.compile(r"frac([^{])(.)")
_SHORT_SQRT = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva/DAPO normalization of a final answer, for exact string comparison: the part after the last "=", without
    spaces, articles and unit words, `$...$`, `\\text{}`, `\\textbf{}`, `\\overline{}` and `\\boxed{}` unwrapped,
    `\\fracab` and `\\sqrta` expanded, and thousands separators removed from plain non-negative integers."""
    text = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        text = text.replace(old, new)
    for expression in _REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    text = _FIRST_INLINE_MATH.sub(r"$\1$", text)
    for pattern in _UNWRAP_COMMANDS:
        text = pattern.sub(r"\1", text)
    text = _UNWRAP_BOXED.sub(r"\1", text)
    text = _SHORT_FRAC.sub(r"frac{\1}{\2}", text)
    text = _SHORT_SQRT.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_answer_line(text: str) -> str | None:
    """What follows the last `Answer:` (any case) up to the end of its line, or None."""
    matches = ANSWER_LINE_PATTERN.findall(text)
    return matches[-1] if matches else None


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, braces balanced, or None (also when the last box never closes)."""
    opener = "\\boxed{"
    start = text.rfind(opener)
    if start < 0:
        return None
    depth = 0
    for index in range(start + len(opener) - 1, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(opener) : index]
    return None
