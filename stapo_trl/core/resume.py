"""What makes a resumed run continue exactly where it stopped: a checkpoint counts only when its ``trainer_state.json``
(written last) exists, and `EpochSeededSampler` gives every epoch the order it has in a straight run (TRL's
``RepeatSampler`` would repeat the first epoch's shuffle after a resume at an epoch boundary).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from torch.utils.data import Sampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .errors import UsageError
from .names import TRAINER_STATE_FILE

# The TRL boundary (which imports TRL) is imported where a sampler is reseeded: `stapo-trl report` reads
# checkpoints through this module without loading TRL.

logger = logging.getLogger(__name__)

LAST_CHECKPOINT_VALUES = ("true", "last")
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class ResumeError(UsageError, ValueError):
    """A ``resume_from_checkpoint`` that cannot be resumed from; the message says which checkpoint can."""


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint directory whose save finished (its ``trainer_state.json``, written last, exists)."""
    return (Path(path) / TRAINER_STATE_FILE).is_file()


def checkpoints_by_step(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` directories of ``output_dir``, oldest step first."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [(int(match[1]), path) for path in directory.iterdir() if (match := _CHECKPOINT_NAME.match(path.name))]
    return [path for _, path in sorted(found) if path.is_dir()]


def last_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of ``output_dir``; newer incomplete ones are skipped with a warning."""
    for path in reversed(checkpoints_by_step(output_dir)):
        if is_complete_checkpoint(path):
            return path
        logger.warning(
            "Skipping %s: it has no %s, so its save was interrupted (the run was killed while saving).",
            path,
            TRAINER_STATE_FILE,
        )
    return None


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint to resume from, for ``resume_from_checkpoint`` as given to ``train()`` or in a recipe.

    ``None``/``False``/``""`` start fresh. ``True``, ``"true"`` or ``"last"`` mean the newest complete checkpoint of
    ``output_dir``. Anything else is a checkpoint directory, which must be complete.
    """
    if value is None or value is False or value == "":
        return None
    if value is True or (isinstance(value, str) and value.lower() in LAST_CHECKPOINT_VALUES):
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ResumeError(
                f"resume_from_checkpoint={value!r}, but {output_dir} holds no complete {PREFIX_CHECKPOINT_DIR}-N "
                f"directory (one with {TRAINER_STATE_FILE}). Start without resume_from_checkpoint, or point it at a "
                "checkpoint directory."
            )
    elif not Path(value).is_dir():
        raise ResumeError(
            f"resume_from_checkpoint={value!r} is not a directory. Pass a {PREFIX_CHECKPOINT_DIR}-N directory, or "
            "'last' for the newest complete checkpoint of output_dir."
        )
    elif not is_complete_checkpoint(path := Path(value)):
        newest = last_complete_checkpoint(path.parent)
        hint = f" The newest complete checkpoint is {newest}." if newest is not None else ""
        raise ResumeError(
            f"{path} has no {TRAINER_STATE_FILE}: its save was interrupted, and resuming from it would restart at "
            f"step 0.{hint}"
        )
    check_checkpoint_files(path)
    return str(path)


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """Raise ``ResumeError`` when a ``*.safetensors`` file of the checkpoint has a header that cannot be read (a file
    cut short or overwritten), before any model is loaded from it. Reads the headers only."""
    for weights in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own SafetensorError, or OSError
            newest = [
                other
                for other in checkpoints_by_step(Path(path).parent)
                if other != Path(path) and is_complete_checkpoint(other)
            ]
            hint = f" Resume from an earlier checkpoint, such as {newest[-1]}." if newest else ""
            raise ResumeError(f"{weights} cannot be read ({error}): the checkpoint is damaged.{hint}") from None


class EpochSeededSampler(Sampler):
    """TRL's ``RepeatSampler`` with a ``set_epoch(e)`` that reseeds its shuffle and replays the ``e`` permutations of
    the earlier epochs, so the next pass is the straight run's epoch ``e``."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        from .trl_seams import reseed_repeat_sampler

        reseed_repeat_sampler(self.sampler, epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
