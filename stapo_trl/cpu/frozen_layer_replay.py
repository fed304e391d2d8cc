"""The frozen bottom layers of a LoRA policy computed once per distinct sequence, not at `generate()`'s first forward
and again in TRL's loss pass (docs/training.md): `FrozenPrefixReplay` shares the prefill between repeated prompts and
hands the first trainable layer the input it recorded. Same hidden states up to rounding; no random draw."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core.distributed import world_size
from ..trl_boundary.helpers import decoder_layer_cache, decoder_layers

logger = logging.getLogger(__name__)


class _StandIn(torch.nn.Module):
    """Stands in for a frozen layer: passes its input through, or returns the next of the ``recorded`` inputs."""

    def __init__(self, recorded: list[torch.Tensor] | None = None):
        super().__init__()
        self.recorded = None if recorded is None else list(recorded)

    def forward(self, hidden_states, *args, **kwargs):
        if self.recorded is None:
            return hidden_states
        if not self.recorded:
            raise RuntimeError("frozen layers skipped: more forward calls than recorded inputs")
        recorded = self.recorded.pop(0)
        if recorded.shape != hidden_states.shape:
            raise RuntimeError(
                f"frozen layers skipped: a recorded input of shape {tuple(recorded.shape)} for a call of shape "
                f"{tuple(hidden_states.shape)}: the sequences are not the recorded ones"
            )
        return recorded


def wrap_methods(model: torch.nn.Module, **wrappers: Callable) -> Callable[[], None]:
    """Make each ``model.<name>(...)`` call ``wrapper(original, ...)``, with the original's name and signature; returns
    the function that puts the originals back."""
    own = {name: vars(model).get(name) for name in wrappers}
    for name, wrapper in wrappers.items():
        original = getattr(model, name)
        setattr(model, name, functools.wraps(original)(functools.partial(wrapper, original)))

    def restore() -> None:
        for name, method in own.items():
            if method is None:
                delattr(model, name)
            else:
                setattr(model, name, method)

    return restore


def _put_back(layers: torch.nn.ModuleList, originals: list[torch.nn.Module]) -> None:
    for index, layer in enumerate(originals):
        layers[index] = layer


@contextmanager
def _frozen_layers_skipped(layers: torch.nn.ModuleList, first_trainable: int, recorded: list[torch.Tensor]):
    """Within, the frozen layers do not run: the first trainable layer gets the ``recorded`` inputs, one per call."""
    frozen = list(layers[:first_trainable])
    try:
        for index in range(first_trainable):
            layers[index] = _StandIn(recorded if index == 0 else None)
        yield
    finally:
        _put_back(layers, frozen)


@contextmanager
def _layer_inputs(layer: torch.nn.Module, inverse: Callable[[], torch.Tensor | None] = lambda: None):
    """The input of ``layer`` at each call in the block, detached; one on ``inverse()``'s distinct rows is expanded."""
    inputs: list[torch.Tensor] = []

    def record(module, args, kwargs):
        hidden_states = (args[0] if args else kwargs["hidden_states"]).detach()
        rows = inverse()
        if rows is not None and hidden_states.shape[0] < rows.shape[0]:
            hidden_states = hidden_states.index_select(0, rows)
        inputs.append(hidden_states)

    handle = layer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield inputs
    finally:
        handle.remove()


def _rows(value, index: torch.Tensor, batch: int):
    """``value`` (a tensor, or a tuple of them) with only the rows ``index`` where its first dimension is the batch."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_rows(item, index, batch) for item in value)
    return value


class _SharedPrefill(torch.nn.Module):
    """Runs ``layers`` on one row per distinct prompt, copies their cache entries to the repeats."""

    def __init__(self, layers: list[torch.nn.Module], first: torch.Tensor, inverse: torch.Tensor, on_call):
        super().__init__()
        self.shared_layers, self.first, self.inverse, self.on_call = layers, first, inverse, on_call

    def forward(self, hidden_states, *args, **kwargs):
        batch = hidden_states.shape[0]
        cache = decoder_layer_cache(kwargs)
        shared = batch == self.inverse.shape[0] and cache is not None and len(cache.layers) >= len(self.shared_layers)
        self.on_call(shared)
        if shared:
            args = [_rows(value, self.first, batch) for value in args]
            kwargs = {name: _rows(value, self.first, batch) for name, value in kwargs.items()}
            hidden_states = hidden_states.index_select(0, self.first)
        for layer in self.shared_layers:
            hidden_states = layer(hidden_states, *args, **kwargs)
        if not shared:
            return hidden_states
        for index in range(len(self.shared_layers)):
            cache.layers[index].reorder_cache(self.inverse)
        return hidden_states.index_select(0, self.inverse)


def distinct_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, inverse)`` over the rows of ``tensors`` side by side: each distinct row's first index, and for every
    row the position of its distinct row in ``first``. None when every row is distinct."""
    rows = torch.cat([tensor.reshape(tensor.shape[0], -1).long() for tensor in tensors], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    if count == rows.shape[0]:
        return None
    positions = torch.arange(rows.shape[0], device=rows.device)
    first = torch.full((count,), rows.shape[0], device=rows.device).scatter_reduce(0, inverse, positions, "amin")
    return first, inverse


@dataclass
class _Recording:
    """The first trainable layer's input ``[B, S', H]`` for ``sequences`` ``[B, S]`` (``S - 1`` from `generate()`)."""

    sequences: torch.Tensor
    hidden_states: torch.Tensor
    frozen_version: int
    open_to_more_rows: bool = False


def first_trainable_layer(layers: torch.nn.ModuleList) -> int:
    """The index of the first decoder layer with a parameter that requires grad (``len(layers)`` if none has)."""
    trainable = (index for index, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters()))
    return next(trainable, len(layers))


def active_dropout(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[str]:
    """Dropout that would make the layers' output random in training: modules and config rates above 0."""
    found = [
        f"{type(module).__name__}(p={module.p})"
        for layer in layers
        for module in layer.modules()
        if isinstance(module, torch.nn.Dropout) and module.p > 0
    ]
    for name, value in model.config.get_text_config().to_dict().items():
        if "dropout" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{name}={value}")
    return found


class FrozenPrefixReplay:
    """The shared prefill and the frozen-layer replay on one model (docs/training.md). `shared_prefills` counts the
    generations whose prefill was shared, `shared_layers` the layers the last one covered, `replayed` and `computed`
    the fused-head passes that used the recording and those that ran every layer."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList, first_trainable: int):
        self.model, self.layers, self.first_trainable = model, layers, first_trainable
        self.replayed = self.computed = self.shared_prefills = self.shared_layers = 0
        self.prefill_inverse: torch.Tensor | None = None
        self.recording: _Recording | None = None
        self.generating, self.restore_model = False, None

    def attach(self) -> None:
        self.restore_model = wrap_methods(self.model, generate=self._generate, forward=self._forward)

    def detach(self) -> None:
        if self.computed:
            logger.info(
                f"Frozen-layer replay: {self.computed} of {self.computed + self.replayed} fused-head passes ran every "
                "layer (their sequences were not the last generate()'s)."
            )
        if self.restore_model is not None:
            self.restore_model()
            self.restore_model = None
        self.recording = None

    def _frozen_version(self) -> int:
        return sum(p._version for layer in self.layers[: self.first_trainable] for p in layer.parameters())

    def _first_trainable_inputs(self):
        return _layer_inputs(self.layers[self.first_trainable], lambda: self.prefill_inverse)

    def _generate(self, generate, *args, **kwargs):
        with self._first_trainable_inputs() as chunks:
            self.generating, self.recording = True, None
            shared = self._share_prefill(args, kwargs)
            try:
                output = generate(*args, **kwargs)
            finally:
                self.generating, self.prefill_inverse = False, None
                if shared is not None:
                    _put_back(self.layers, shared)
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        if sequences is not None and chunks and all(c.shape[0] == sequences.shape[0] for c in chunks):
            hidden_states = torch.cat(chunks, dim=1)
            if hidden_states.shape[1] == sequences.shape[1] - 1:
                self.recording = _Recording(sequences, hidden_states, self._frozen_version())
        return output

    def _share_prefill(self, args, kwargs) -> list[torch.nn.Module] | None:
        """Swap in `_SharedPrefill` when prompts repeat; returns the layers it stands in for, or None."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        given_cache = any(kwargs.get(name) is not None for name in ("past_key_values", "cache"))
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or given_cache:
            return None
        everything = list(self.layers)
        covered = everything if not active_dropout(self.model, everything) else everything[: self.first_trainable]
        layer_indices = [getattr(getattr(layer, "self_attn", None), "layer_idx", i) for i, layer in enumerate(covered)]
        if layer_indices != list(range(len(covered))):
            return None
        attention_mask = kwargs.get("attention_mask")
        found = distinct_rows(input_ids, *([] if attention_mask is None else [attention_mask]))
        if found is None:
            return None
        first, inverse = found

        def back_to_the_layers(shared: bool):
            _put_back(self.layers, covered)
            if shared:
                self.shared_prefills += 1
                self.shared_layers = len(covered)
                self.prefill_inverse = inverse

        self.layers[0] = _SharedPrefill(covered, first, inverse, back_to_the_layers)
        for index in range(1, len(covered)):
            self.layers[index] = _StandIn()
        return covered

    def recorded_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The first trainable layer's input for ``input_ids`` ``[b, T]`` from the recording (zeros in an unrecorded
        last column), or None when a row is not in it at the positions ``attention_mask`` keeps."""
        recording = self.recording
        if recording is None or input_ids.dim() != 2 or recording.frozen_version != self._frozen_version():
            return None
        sequences, length = recording.sequences, input_ids.shape[1]
        if length > sequences.shape[1] or input_ids.device != sequences.device:
            return None
        kept = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        same = (input_ids[:, None, :] == sequences[None, :, :length]) | ~kept[:, None, :]
        matches = same.all(dim=-1)
        if not bool(matches.any(dim=-1).all()):
            return None
        hidden_states = recording.hidden_states[matches.int().argmax(dim=-1), :length]
        if hidden_states.shape[1] < length:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, length - hidden_states.shape[1]))
        return hidden_states

    def _forward(self, forward, *args, **kwargs):
        if not kwargs.get("fused_lm_head") or kwargs.get("shift_labels") is not None or self.generating:
            return forward(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        hidden_states = None if input_ids is None else self.recorded_input(input_ids, kwargs.get("attention_mask"))
        if torch.is_grad_enabled() and self.recording is not None:
            self.recording.open_to_more_rows = False
        if hidden_states is None:
            self.computed += 1
            if input_ids is None or input_ids.dim() != 2 or torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return self._recording_forward(forward, input_ids, args, kwargs)
        self.replayed += 1
        with _frozen_layers_skipped(self.layers, self.first_trainable, [hidden_states]):
            return forward(*args, **kwargs)

    def _recording_forward(self, forward, input_ids: torch.Tensor, args: tuple, kwargs: dict):
        """Run every layer, recording the first trainable layer's input (anew, or as more rows of the open one)."""
        with self._first_trainable_inputs() as inputs:
            output = forward(*args, **kwargs)
        if len(inputs) != 1 or inputs[0].shape[:2] != input_ids.shape:
            return output
        version, recording = self._frozen_version(), self.recording
        extend = (
            recording is not None
            and recording.open_to_more_rows
            and recording.frozen_version == version
            and recording.sequences.shape[1] == input_ids.shape[1]
            and recording.sequences.device == input_ids.device
        )
        if extend:
            recording.sequences = torch.cat([recording.sequences, input_ids])
            recording.hidden_states = torch.cat([recording.hidden_states, inputs[0]])
        else:
            self.recording = _Recording(input_ids.clone(), inputs[0], version, open_to_more_rows=True)
        return output


def replay_blockers(model: torch.nn.Module) -> list[str]:
    """Why `FrozenPrefixReplay` cannot run on ``model`` (a transformers causal LM, under PEFT's wrapper or not)."""
    layers, problems = decoder_layers(model)
    if layers is None:
        return problems
    first_trainable = first_trainable_layer(layers)
    if first_trainable == 0:
        return ["the first decoder layer has trainable parameters: there is no frozen prefix"]
    if first_trainable == len(layers):
        return ["no decoder layer has trainable parameters"]
    blockers = [f"dropout in the frozen layers: {found}" for found in active_dropout(model, layers[:first_trainable])]
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        blockers.append("gradient checkpointing")
    if world_size() > 1:
        blockers.append("several processes")
    return blockers


@contextmanager
def replay_frozen_prefix(model: torch.nn.Module) -> Iterator[FrozenPrefixReplay | None]:
    """`FrozenPrefixReplay` on ``model`` (for a PEFT model, ``model.get_base_model()``) inside the block, or None
    (and a log line saying why) when `replay_blockers` finds a reason."""
    if blockers := replay_blockers(model):
        logger.info("Frozen-layer replay is off: %s.", "; ".join(blockers))
        yield None
        return
    layers, _ = decoder_layers(model)
    replay = FrozenPrefixReplay(model, layers, first_trainable_layer(layers))
    replay.attach()
    try:
        yield replay
    finally:
        replay.detach()


def policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT's wrapper (``model`` itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def recording_first_trainable_input(model: torch.nn.Module) -> Iterator[list[torch.Tensor] | None]:
    """The input of ``model``'s first trainable decoder layer at each call in the block, detached, in call order; None
    (and nothing recorded) when `replay_blockers` finds a reason."""
    if replay_blockers(policy_of(model)):
        yield None
        return
    layers, _ = decoder_layers(policy_of(model))
    with _layer_inputs(layers[first_trainable_layer(layers)]) as inputs:
        yield inputs


@contextmanager
def frozen_layers_replaced(model: torch.nn.Module, recorded: list[torch.Tensor]) -> Iterator[None]:
    """Within, ``model``'s frozen bottom decoder layers are not run: the first trainable layer receives, call after
    call, the inputs `recording_first_trainable_input` recorded for the same sequences."""
    layers, _ = decoder_layers(policy_of(model))
    with _frozen_layers_skipped(layers, first_trainable_layer(layers), recorded):
        yield
