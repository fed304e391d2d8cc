"""JSON-lines files written a record at a time (metrics, silenced tokens), which a killed run can leave with its last
line cut off."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. A last line that is not valid JSON is what a kill mid-write leaves: it is
    left out, with a warning. An invalid line anywhere else raises ``ValueError`` naming the file and the line."""
    lines = [
        (number, line) for number, line in enumerate(Path(path).read_text().splitlines(), start=1) if line.strip()
    ]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if index == len(lines) - 1:
                logger.warning("%s: leaving out line %d, cut off mid-write (%s).", path, number, error)
                break
            raise ValueError(f"{path}, line {number}, is not a JSON record ({error}); the file is damaged.") from None
    return records
