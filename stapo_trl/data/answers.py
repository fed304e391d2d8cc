"""Gold answers as text: the one form every dataset loader stores and every reward compares against."""

from __future__ import annotations

import math
from typing import Any


def gold_text(gold: Any) -> str | None:
    """A gold answer as text, or None when there is no usable answer.

    Integral floats lose their ".0" (AMC answers are stored as floats on the Hub), lists are joined with ", "
    (OlympiadBench stores answers as lists), and empty or NaN values give None so that TRL skips the sample.
    """
    if gold is None:
        return None
    if isinstance(gold, float):
        if math.isnan(gold) or math.isinf(gold):
            return None
        return str(int(gold)) if gold.is_integer() else repr(gold)
    if isinstance(gold, (list, tuple)):
        parts = [gold_text(part) for part in gold]
        parts = [part for part in parts if part]
        return ", ".join(parts) if parts else None
    return str(gold).strip() or None
