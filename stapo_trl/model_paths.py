"""What a model reference names on this machine (a saved-model directory, something that is not one, or a Hub id),
for training and evaluation, which both refuse a bad local path before loading anything."""

from __future__ import annotations

import re
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_path(reference: str) -> bool:
    """Whether ``reference`` is written as a path rather than a Hub id (``org/name``)."""
    return reference.startswith((".", "/", "~")) or not HUB_ID.match(reference)


def local_model_problem(reference: str) -> str | None:
    """Why ``reference`` cannot be loaded as a local saved model: ``"missing"`` (a path that does not exist),
    ``"file"`` (a file, not a checkpoint directory) or ``"no_config"`` (a directory with neither config.json nor
    adapter_config.json). None for a saved-model directory, and for a Hub id, which is left to ``from_pretrained``."""
    path = Path(reference).expanduser()
    if path.exists():
        if not path.is_dir():
            return "file"
        if not (path / MODEL_CONFIG).is_file() and not (path / ADAPTER_CONFIG).is_file():
            return "no_config"
        return None
    return "missing" if looks_like_path(reference) else None
