"""`cpu_runtime`: the one entry to stapo-trl's CPU speed-ups, for `stapo-trl train` and for your own script alike."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import transformers.trainer
from transformers import TrainerCallback

from .colocated_vllm import CPUEngineSettings, colocated_vllm_on_cpu, needs_cpu_adapter
from .environment import SWITCH, cpu_environment_not_in_effect
from .frozen_layer_replay import FrozenPrefixReplay, policy_of, replay_frozen_prefix
from .kv_cache import inplace_kv_cache
from .lm_head import cpu_lm_head

logger = logging.getLogger(__name__)

_ACTIVE: ContextVar[CPURuntime | None] = ContextVar("stapo_trl_cpu_runtime", default=None)


@dataclass
class CPURuntime:
    """What `cpu_runtime` turned on for its block."""

    on_cpu: bool
    """Whether the arguments train on the CPU; when not, nothing else is on."""
    lm_head: bool = False
    colocated_vllm: CPUEngineSettings | None = None
    """The settings of colocated vLLM on vLLM's CPU backend, when the arguments ask for colocated vLLM."""
    replay_frozen_layers: bool = False
    inplace_kv_cache: bool = False
    """Attached trainers get the frozen-layer replay (where their model allows) and the in-place key/value cache."""
    environment_not_in_effect: dict[str, str] = field(default_factory=dict)
    replays: dict[int, FrozenPrefixReplay | None] = field(default_factory=dict)
    """The frozen-layer replay of each attached policy model, by ``id`` (None where the model does not allow it)."""
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)

    def attach(self, trainer) -> FrozenPrefixReplay | None:
        """Attach a trainer that does not train (trainers are attached when their training begins) until the block
        ends. Returns its replay (None when off or not allowed); a model attached twice keeps its first replay."""
        return self.attach_model(trainer.accelerator.unwrap_model(trainer.model))

    def attach_model(self, model) -> FrozenPrefixReplay | None:
        if not (self.replay_frozen_layers or self.inplace_kv_cache):
            return None
        policy = policy_of(model)
        if id(policy) not in self.replays:
            self.replays[id(policy)] = None
            if self.inplace_kv_cache:
                self._stack.enter_context(inplace_kv_cache(policy))
            if self.replay_frozen_layers:
                self.replays[id(policy)] = self._stack.enter_context(replay_frozen_prefix(policy))
        return self.replays[id(policy)]

    def replay_of(self, trainer) -> FrozenPrefixReplay | None:
        """The frozen-layer replay attached to ``trainer``'s policy model, or None."""
        return self.replays.get(id(policy_of(trainer.accelerator.unwrap_model(trainer.model))))


class AttachAtTrainBegin(TrainerCallback):
    """Attaches a trainer's policy model to the `CPURuntime` when its training begins."""

    def __init__(self, runtime: CPURuntime):
        self.runtime = runtime

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.runtime.attach_model(model)


def active_cpu_runtime() -> CPURuntime | None:
    """The innermost `cpu_runtime` block this code runs in, or None."""
    return _ACTIVE.get()


@contextmanager
def cpu_runtime(
    args: Any, *, lm_head: bool = True, replay_frozen_layers: bool = True, inplace_kv_cache: bool = True
) -> Iterator[CPURuntime]:
    """Turn on stapo-trl's CPU speed-ups (docs/training.md) for the trainers built and trained inside the block when
    ``args.device`` (the trainer's arguments) is the CPU: the CPU LM head, process-wide; colocated vLLM when ``args``
    ask for it; the frozen-layer replay and the in-place key/value cache for every trainer attached. The keyword
    arguments turn each off. Warns of missing CPU environment defaults; yields the `CPURuntime` saying what is on."""
    runtime = CPURuntime(on_cpu=args.device.type == "cpu")
    with runtime._stack:
        if runtime.on_cpu:
            runtime.environment_not_in_effect = cpu_environment_not_in_effect()
            if runtime.environment_not_in_effect:
                settings = " ".join(f"{name}={value}" for name, value in runtime.environment_not_in_effect.items())
                logger.warning(
                    f"CPU training runs without {settings}: torch reads these only when it loads. Set them in the "
                    "shell, or call stapo_trl.cpu.environment.set_cpu_environment() before anything imports torch "
                    f"({SWITCH}=0 silences this)."
                )
            if lm_head:
                runtime._stack.enter_context(cpu_lm_head())
                runtime.lm_head = True
            if needs_cpu_adapter(args.use_vllm, args.vllm_mode, "cpu"):
                runtime.colocated_vllm = runtime._stack.enter_context(colocated_vllm_on_cpu())
            runtime.replay_frozen_layers = replay_frozen_layers
            runtime.inplace_kv_cache = inplace_kv_cache
            if replay_frozen_layers or inplace_kv_cache:
                attach = AttachAtTrainBegin(runtime)
                transformers.trainer.DEFAULT_CALLBACKS.append(attach)
                runtime._stack.callback(transformers.trainer.DEFAULT_CALLBACKS.remove, attach)
        token = _ACTIVE.set(runtime)
        try:
            yield runtime
        finally:
            _ACTIVE.reset(token)
