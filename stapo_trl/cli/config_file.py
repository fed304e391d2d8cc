"""The YAML config file of `stapo-trl train` (the recipe) and `stapo-trl eval`, checked before anything is loaded (a
bad key or value is refused, saying what to write instead); its values become the `TrlParser`'s defaults."""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import UsageError

ENV_KEY = "env"
"""The key under which a config file sets environment variables, as in TRL's `TrlParser`."""


@dataclass(frozen=True)
class ConfigFileKind:
    """How one command names its config file in messages, and the error it raises for a bad one."""

    command: str
    noun: str
    example: str
    """Where to find or how to write one (the message about a missing file says it)."""
    error: type[UsageError]

    def refuse(self, message: str):
        """`argparse`'s error handler: raise instead of printing the usage of every option and exiting."""
        raise self.error(message)


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key (PyYAML keeps the last value without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(
                    f"the key {key!r} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1}); YAML would "
                    "silently keep the second. Keep one."
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | os.PathLike, kind: ConfigFileKind) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (``{}`` for an empty file), or ``kind.error``."""
    path = Path(path)
    if path.is_dir():
        found = sorted(str(child) for child in path.glob("*.yaml"))
        example = f", for example {found[0]}." if found else "."
        raise kind.error(f"{path} is a directory; --config takes one YAML {kind.noun}{example}")
    if not path.is_file():
        raise kind.error(f"{kind.noun.capitalize()} not found: {path}. Pass the path of a YAML file, {kind.example}.")
    try:
        config = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise kind.error(f"{path} is not valid YAML: {error}") from None
    except _DuplicateKey as error:
        raise kind.error(f"{path}: {error}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise kind.error(f"{path} must hold a YAML mapping of keys to values, not a {type(config).__name__}.")
    return config


def split_flags(argv: list[str], names) -> tuple[dict[str, str | None], list[str]]:
    """The last value of each flag in ``names`` (``--name value`` or ``--name=value``; None if it ends ``argv``)
    and the other tokens."""
    values, rest, tokens = {}, [], iter(argv)
    for token in tokens:
        name, has_value, value = token.partition("=")
        if name in names:
            values[name] = value if has_value else next(tokens, None)
        else:
            rest.append(token)
    return values, rest


def read_config_flag(argv: list[str], kind: ConfigFileKind) -> tuple[Path | None, dict[str, Any], list[str]]:
    """The ``--config`` path (or None), the file's mapping (or ``{}``) and the rest of ``argv``."""
    flags, rest = split_flags(argv, ("--config",))
    if "--config" not in flags:
        return None, {}, rest
    if flags["--config"] is None:
        raise kind.error(f"--config needs the path of a YAML {kind.noun}.")
    path = Path(flags["--config"])
    return path, read_config_file(path, kind), rest


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``candidates``, or nothing."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {matches[0]!r}?" if matches else ""


def parser_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each destination of ``parser`` and its ``--name`` action (not `HfArgumentParser`'s ``--no_name``)."""
    return {action.dest: action for action in reversed(parser._actions) if action.dest != "help"}  # the first wins


def apply_config(parser, config: Mapping[str, Any], where: str, kind: ConfigFileKind, *, known=(), reasons=None):
    """Check ``config`` against ``parser``, set its ``env`` in this process and return the values of the parser's
    arguments, each converted as the parser converts a flag's. Every key that is not an argument, in ``known`` or ``env``
    is refused in one message, each with its reason (``reasons``) or the closest argument. ``parser``'s errors raise
    ``kind.error`` from here on."""
    parser.error = kind.refuse
    actions = parser_actions(parser)
    known, reasons = {*actions, *known, ENV_KEY}, reasons or {}
    unknown = [
        f"  {key}: " + (f"{reasons[key]}." if key in reasons else "not a known key." + suggest(str(key), actions))
        for key in config
        if key not in known
    ]
    if unknown:
        raise kind.error(f"{where} has keys that {kind.command} does not know:\n" + "\n".join(unknown))
    annotations = {}
    for dataclass_type in reversed(parser.dataclass_types):  # the first dataclass that has a field names its type
        for item in fields(dataclass_type):
            annotations[item.name] = item.type.__name__ if isinstance(item.type, type) else str(item.type)
    values = {
        key: _checked_value(value, actions[key], annotations.get(key, ""), f"{where}: {key}", kind)
        for key, value in config.items()
        if key in actions
    }
    env = config.get(ENV_KEY) or {}
    if not isinstance(env, dict):
        raise kind.error(f"{where}: env must be a mapping of environment variables to values.")
    for name, value in env.items():
        os.environ[str(name)] = str(value)
    return values


def _checked_value(value: Any, action: argparse.Action, annotation: str, where: str, kind: ConfigFileKind):
    expected = annotation or getattr(action.type, "__name__", "")
    if value is None:
        if "None" in annotation or action.default is None:
            return None
        raise kind.error(f"{where} has no value; it needs a {expected}.")
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, dict | list):
                raise kind.error(
                    f"{where} takes a list of single values ({annotation}); an entry is a {type(item).__name__}: "
                    f"{item!r}."
                )
        return [_checked_scalar(item, action, annotation, where, kind) for item in items]
    if isinstance(value, dict | list):
        # Several TrainingArguments fields typed `str` also take a list or a dict (report_to, fsdp, *_kwargs).
        if action.type is str or "dict" in annotation or "list" in annotation:
            return value
        raise kind.error(f"{where} must be a single value ({annotation}), not a {type(value).__name__}.")
    return _checked_scalar(value, action, annotation, where, kind)


def _checked_scalar(value, action, annotation, where, kind):
    type_function = action.type
    type_name = getattr(type_function, "__name__", "")

    def fail(reason: str) -> UsageError:
        return kind.error(f"{where}: {reason} (got {value!r}; expected {annotation or type_name}).")

    if type_name == "string_to_bool":
        if isinstance(value, bool):
            return value
        if not isinstance(value, str):
            raise fail("not a boolean; write true or false")
        try:
            return type_function(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise fail("not a boolean") from None
    if isinstance(value, bool) and annotation.split("|")[0].strip() in ("int", "float"):
        raise fail("a boolean where a number is needed; YAML reads an unquoted yes, no, on, off, true or false as one")
    if type_function is int and isinstance(value, float) and not value.is_integer():
        raise fail("not a whole number")
    converted = value
    if callable(type_function):
        try:
            converted = type_function(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise fail("wrong type") from None
    if action.choices is not None and converted not in action.choices:
        raise kind.error(
            f"{where} must be one of {list(action.choices)}, got {value!r}."
            + suggest(str(value), [str(choice) for choice in action.choices])
        )
    return converted
