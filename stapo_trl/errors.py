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
