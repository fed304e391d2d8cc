"""Shared by every group of tests (unit/, integration/, conformance/, repository/).

This directory goes on ``sys.path``, so the helpers beside this file (``tiny.py``, ``loss_batches.py``,
``trl_engine_arguments.py``) import by their names from any group: ``from tiny import build_tiny_qwen3``. The
worker scripts that tests launch as processes put it there themselves.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
