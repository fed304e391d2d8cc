"""The kind of exception that the command line turns into a message instead of a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """Input the user can fix (a recipe, path, dataset, reward name, checkpoint or output directory); the message says
    what to change. The command line prints it and exits with code 2 (the traceback with ``--traceback``).
    """


class UserCodeError(Exception):
    """An exception raised in training by the user's own code (a reward function, a callback, an environment), or
    TRL's refusal of what that code returned. It names the code (``source``) and the optimizer step (``step``, the
    step being prepared when it raised); the original exception is its ``__cause__``."""

    def __init__(self, message: str, *, source: str, step: int):
        super().__init__(message)
        self.source = source
        self.step = step
