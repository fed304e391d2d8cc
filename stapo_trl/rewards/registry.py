"""Rewards registered by name, so recipes can list them as `reward_funcs: [boxed, math_verify]`."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RegisteredReward:
    """A registry entry: `build(**options)` returns the reward callable."""

    build: Callable[..., Callable]
    description: str


REWARD_REGISTRY: dict[str, RegisteredReward] = {}


def register_reward(name: str, *, description: str = "", factory: bool = False):
    """Register a reward function, or with `factory=True` a function that builds one from keyword options."""

    def decorator(obj: Callable) -> Callable:
        if name in REWARD_REGISTRY:
            raise ValueError(f"A reward named {name!r} is already registered.")

        def build(**options: Any) -> Callable:
            if options:
                raise TypeError(f"The {name!r} reward takes no options, got {sorted(options)}.")
            return obj

        summary = description or (obj.__doc__ or "").strip().split("\n")[0]
        REWARD_REGISTRY[name] = RegisteredReward(build=obj if factory else build, description=summary)
        return obj

    return decorator


def available_rewards() -> dict[str, str]:
    """Registered names and one-line descriptions."""
    return {name: entry.description for name, entry in sorted(REWARD_REGISTRY.items())}


def _import_object(path: str) -> Any:
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{path!r} is not a dotted import path such as 'my_pkg.rewards.my_reward'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"Cannot import module {module_name!r} for reward {path!r}: {error}") from error
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"Module {module_name!r} has no attribute {attribute!r} (reward {path!r}).")
        obj = getattr(obj, part)
    return obj


def get_reward_func(name: str | Callable, **options: Any) -> Callable:
    """A TRL reward callable `f(completions, solution, **kwargs) -> list[float | None]` from a registered name
    (`available_rewards()`) or a dotted import path (`pkg.module.func`, `pkg.module:func`); a callable is returned
    unchanged. `options` configure a registered reward that takes them (`get_reward_func("soft_overlong_punishment",
    max_completion_len=1024, soft_punish_cache=256)`), or are passed to the object at a dotted path, a factory."""
    if callable(name):
        if options:
            raise TypeError("Options are only accepted with a reward name, not with a callable.")
        return name
    if not isinstance(name, str):
        raise TypeError(f"A reward is given by name or dotted path, got {type(name).__name__}.")
    if (entry := REWARD_REGISTRY.get(name)) is not None:
        try:
            return entry.build(**options)
        except TypeError as error:
            raise TypeError(f"Bad options for reward {name!r}: {error}") from error
    if "." in name or ":" in name:
        obj = _import_object(name)
        if options:
            obj = obj(**options)
        if not callable(obj):
            raise TypeError(f"{name!r} resolved to a {type(obj).__name__}, which is not callable.")
        return obj
    known = ", ".join(sorted(REWARD_REGISTRY))
    raise ValueError(
        f"Unknown reward {name!r}. Registered rewards: {known}. For your own function, give its dotted import path, "
        "for example 'my_package.rewards.my_reward'."
    )


class PlainTextCompletions:
    """A reward for conversational completions that also takes plain strings (as one assistant message); it keeps the
    reward's `__name__` and pickles like TRL's rewards."""

    def __init__(self, reward: Callable) -> None:
        self.reward = reward
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)
        functools.update_wrapper(self, reward, assigned=("__doc__", "__module__", "__qualname__"), updated=())

    def __call__(self, completions: list, **kwargs: Any) -> list:
        as_messages = [
            [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
            for completion in completions
        ]
        return self.reward(as_messages, **kwargs)
