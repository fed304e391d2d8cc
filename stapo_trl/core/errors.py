"""The kind of exception that the command line turns into a message instead of a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """Input the user can fix: a recipe, path, dataset, reward name, checkpoint or output directory that cannot be used
    as given. The message names the mistake and says what to change.

    `stapo-trl train`, `eval` and `report` print the message and exit with code 2; with `--traceback` (or
    `STAPO_TRL_TRACEBACK=1`) they print the traceback as well. Every error class of stapo-trl that describes such
    input derives from it, next to the built-in class it has always been (``ValueError``, ``FileNotFoundError``,
    ``RuntimeError``), so code that catches those keeps working.
    """


class UserCodeError(Exception):
    """An exception raised in training by the user's own code (a reward function, a callback, an environment), or
    TRL's refusal of what that code returned. It names the code (``source``) and the optimizer step (``step``, the
    step being prepared when it raised); the original exception is its ``__cause__``."""

    def __init__(self, message: str, *, source: str, step: int):
        super().__init__(message)
        self.source = source
        self.step = step
