"""Shared by every group of tests (unit/, integration/, conformance/, repository/).

This directory goes on ``sys.path``, so the helpers beside this file (``tiny.py``, ``loss_batches.py``,
``trl_engine_arguments.py``) import by their names from any group: ``from tiny import build_tiny_qwen3``. The
worker scripts that tests launch as processes put it there themselves.

The fixtures here are the ones several files used to define alike. `tiers.py`, registered
here, sets the two tiers (``python -m pytest``, ``python -m pytest -m slow``) and keeps the default one fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stapo_trl.cpu.environment import set_cpu_environment

# Before anything imports torch, as `stapo-trl train` does: torch's OpenMP threads sleep between parallel regions
# instead of spinning. Measured on the shared 2-core machine (docs/records/test-tiers.md), seven tiny-model tests of
# tests/integration/test_trainer.py took 55 s of CPU time with spinning threads and 8 s without, and passed alike.
# Test processes inherit the variables (a user's own values are kept).
set_cpu_environment()

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiers import Tiers  # noqa: E402  (importable once TESTS is on sys.path)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Tiers(), "stapo-tiers")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 with the character tokenizer and a plain chat template, saved like a Hub checkpoint
    (`tiny.save_tiny_chat_model`). Module-scoped: each test file gets its own copy, so a file may add to it (a model
    card, say) by overriding this fixture without touching another file's model."""
    from tiny import save_tiny_chat_model  # here, so that a run that needs no model does not import transformers

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-model"))
