"""The files stapo-trl writes: atomically and durably (a flushed temporary file, then a rename), OS errors naming their
file, storage failures explained, damaged files named with what to do, and JSON lines read up to the last whole
record."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .core.errors import UsageError

logger = logging.getLogger(__name__)

STORAGE_PROBLEMS = {  # the OS errors that say the storage failed, not the program, and what each means
    errno.EROFS: "the filesystem is read-only",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file is larger than the filesystem or a limit (ulimit -f) allows",
    errno.EACCES: "this user may not write there (permissions)",
    errno.EPERM: "the operation is not permitted there (permissions)",
    errno.EIO: "the storage reported an input/output error",
}


class DamagedFileError(UsageError, ValueError):
    """A file stapo-trl wrote that cannot be read back (cut off by a kill, or edited); the message names it."""


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an OS error raised inside without a file name (a write that hit a full disk, say) with ``path``."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise type(error)(error.errno, error.strerror or os.strerror(error.errno), str(path)) from error


UNSYNCABLE_DIRECTORY = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}  # fsync of a directory on some network/FUSE


def sync_file(path: str | os.PathLike) -> None:
    """Flush the file ``path`` from the operating system's cache to the storage (``fsync``)."""
    with naming(path):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def sync_directory(path: str | os.PathLike) -> None:
    """Flush the directory ``path``'s entries to the storage, where the operating system and file system can."""
    if os.name == "nt":
        return
    try:
        sync_file(path)
    except OSError as error:
        if error.errno not in UNSYNCABLE_DIRECTORY:
            raise


def sync_tree(root: str | os.PathLike) -> None:
    """`sync_file` for every file under ``root`` and `sync_directory` for every directory."""
    for directory, _, files in os.walk(root):
        for name in files:
            sync_file(os.path.join(directory, name))
        sync_directory(directory)


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through ``path.partial``, flushed to the storage, and a rename (its directory flushed
    after): a reader, even after a power loss, sees the old file or the new one, never a file cut short or empty."""
    path = Path(path)
    staging = path.with_name(path.name + ".partial")
    _write_durably(staging, text, "w")
    os.replace(staging, path)
    sync_directory(path.parent)
    return path


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to ``path`` and flush it to the storage (``fsync``); an OS error names the file."""
    _write_durably(path, text, "a")


def _write_durably(path: str | os.PathLike, text: str, mode: str) -> None:
    with naming(path), open(path, mode, encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def read_json_file(path: str | os.PathLike, what: str, remedy: str) -> Any:
    """The JSON value in ``path``, a file stapo-trl wrote; one that cannot be parsed raises `DamagedFileError`."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{path} ({what}) is damaged: {error}. {remedy}") from None


def read_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. An invalid last line (a kill mid-write) is left out with a warning; an
    invalid line anywhere else raises ``ValueError`` naming the file and the line."""
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


RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # an OS error in a Rust library's message (safetensors)


def storage_problem(error: BaseException, location: str | os.PathLike | None = None) -> str | None:
    """A sentence naming the file (else ``location``, the directory being written) and the likely cause when ``error``
    or an exception it was raised from is a storage failure, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        number = error.errno if isinstance(error, OSError) else None
        if number is None and (match := RUST_OS_ERROR.search(str(error))):
            number = int(match.group(1))
        if number in STORAGE_PROBLEMS:
            filename = getattr(error, "filename", None)
            where = filename or (f"a file in {location}" if location is not None else "a file")
            return f"could not write {where}: {os.strerror(number)} ({STORAGE_PROBLEMS[number]})"
        error = error.__cause__ or error.__context__
    return None
