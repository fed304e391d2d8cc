"""TRL's completions (strings, or lists of message dicts) and gold answers (any dataset column value) as plain text,
for every reward."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from ..data.sources import gold_text

logger = logging.getLogger(__name__)


@functools.cache
def _warn_once(kind: str, type_name: str) -> None:
    logger.warning(
        f"A reward received a {kind} of type {type_name}; it is read as str(value). Pass strings or chat messages "
        "instead."
    )


def content_text(content: Any) -> str:
    """Text of one message's `content`: a string, a list of content blocks, or None (empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                if block.get("type", "text") == "text" and block.get("text") is not None:
                    parts.append(content_text(block["text"]))
            else:
                _warn_once("content block", type(block).__name__)
                parts.append(str(block))
        return "".join(parts)
    _warn_once("message content", type(content).__name__)
    return str(content)


def completion_text(completion: Any) -> str:
    """The text a reward grades: a string as is; of a list of messages, the content of the last assistant message
    (of the last message when none has a role, so tool turns are skipped); a message dict's content; "" for None."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [message for message in completion if isinstance(message, dict)]
        if not messages:
            return "".join(content_text(part) for part in completion)
        assistant = [message for message in messages if message.get("role", "assistant") == "assistant"]
        return content_text((assistant or messages)[-1].get("content"))
    _warn_once("completion", type(completion).__name__)
    return str(completion)


def pair_up(completions: Sequence[Any], solution: Sequence[Any] | None, reward_name: str):
    """Texts and gold answers of one call, checked to be one gold answer per completion."""

    def require_list(value: Any, name: str, one: str) -> None:
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
            raise TypeError(f"{reward_name}: `{name}` must be a list with one {one}, got {type(value).__name__}.")

    require_list(completions, "completions", "completion per sample")
    if solution is None:
        raise ValueError(
            f"{reward_name} needs the gold answers in a `solution` column (one per completion); none was passed. "
            "Load data with stapo_trl.data.load_dapo_math or load_benchmark, which add that column."
        )
    require_list(solution, "solution", "gold answer per completion")
    solution = list(solution)
    if len(solution) != len(completions):
        raise ValueError(
            f"{reward_name} got {len(completions)} completions but {len(solution)} gold answers in `solution`; "
            "they must pair one to one."
        )
    return [completion_text(c) for c in completions], [gold_text(g) for g in solution]
