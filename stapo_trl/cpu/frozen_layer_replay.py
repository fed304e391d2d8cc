"""The frozen bottom layers of the policy, computed once per distinct sequence instead of three times per sample.

With LoRA on the last layers only (the CPU quickstart adapts the last 8 of 30), the layers below the first adapted
one have no trainable parameter and no active dropout: their output for a sequence is a fixed function of its tokens.
A GRPO step nevertheless runs them on each prompt once per sample at `generate()`'s first forward (16 identical
prompts per group in the quickstart), then on every prompt and completion again in TRL's loss pass.
`FrozenPrefixReplay` does that work once:

- at `generate()`'s first forward, the decoder layers run on one row per distinct prompt (and attention mask), and
  their outputs and key/value cache entries are copied to the repeats: every layer when none has active dropout (the
  repeats of a prompt then compute the same thing), otherwise only the frozen ones, so that the layers above run on
  every row and their dropout draws independently per sample;
- during `generate()`, the input of the first trainable layer is recorded at every position;
- when `generate()` did not produce the sequences (colocated vLLM samples them), a fused-head pass without gradients
  over them (TRL's old-log-prob pass) runs every layer and records that input; the rows of consecutive such passes
  (TRL runs it in chunks) join one recording, until a pass with gradients replays from it;
- when TRL's fused LM head later scores sequences that were recorded, the recording is handed to the first trainable
  layer instead of running the frozen ones.

What it gives: the same hidden states up to floating-point rounding (incremental decoding with a KV cache against
one full forward; on the CPU quickstart the log-probabilities moved by at most 2e-5), for a fraction of the frozen
layers' cost. It draws no random numbers, so the run's random streams are unchanged.

When the replay steps aside (the loss pass then runs every layer): a sequence of the batch that the recording does
not hold (the last `generate()`'s, or the passes without gradients since the last pass with them), with the same
tokens at every position its attention mask keeps and at the same column; a frozen layer's parameters changed in
place since the recording; positions scored without TRL's shift (``shift_labels``, used under context parallelism),
since the last sampled token was never fed back and has no recording, and TRL's shifted head drops that position; a
call made inside `generate()`. The shared prefill steps aside when every prompt is distinct, when a cache is handed
to `generate()`, or when the cache is not one whose entries can be re-indexed.
Neither is installed (`replay_frozen_prefix` yields None) when the model has no frozen bottom layer, when a frozen
layer has active dropout, with gradient checkpointing, under `torch.distributed` with several processes, or when the
backbone does not loop over its decoder layers as transformers' decoder-only models do.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core.distributed import world_size
from ..trl_boundary.helpers import decoder_layer_cache, decoder_layers

logger = logging.getLogger(__name__)


class _StandIn(torch.nn.Module):
    """Stands in for a frozen layer: returns ``recorded`` (for the first frozen layer, the recorded input of the first
    trainable layer), or its input unchanged when there is none (the other frozen layers)."""

    def __init__(self, recorded: torch.Tensor | None = None):
        super().__init__()
        self.recorded = recorded

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.recorded is None else self.recorded


def _rows(value, index: torch.Tensor, batch: int):
    """``value`` with only the rows ``index`` of its batch dimension, for the tensors (alone or in a tuple) whose
    first dimension is the batch; everything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_rows(item, index, batch) for item in value)
    return value


class _SharedPrefill(torch.nn.Module):
    """Stands in for the first decoder layer at `generate()`'s first forward: runs ``layers`` (the first few decoder
    layers, in order) on one row per distinct prompt, copies their keys and values in the cache to the repeats, and
    returns every row's output."""

    def __init__(self, layers: list[torch.nn.Module], first: torch.Tensor, inverse: torch.Tensor, on_call):
        super().__init__()
        self.shared_layers = layers
        self.first = first
        self.inverse = inverse
        self.on_call = on_call

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
    """``(first, inverse)`` over the rows of ``tensors`` side by side: the index of each distinct row's first
    occurrence, and for every row the position of its distinct row in ``first``. None when every row is distinct."""
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
    sequences: torch.Tensor
    """``[B, S]``: the prompts and the sampled tokens, as `generate()` returned them or a pass without gradients
    read them."""
    hidden_states: torch.Tensor
    """``[B, S', H]``: the first trainable layer's input at every position fed to the model (``S' = S - 1`` from
    `generate()`, whose last sampled token is never fed back; ``S`` from a forward pass)."""
    frozen_version: int
    open_to_more_rows: bool = False
    """A recording of passes without gradients that the next such pass extends."""


def first_trainable_layer(layers: torch.nn.ModuleList) -> int:
    """The index of the first decoder layer with a parameter that requires grad (``len(layers)`` if none has)."""
    for index, layer in enumerate(layers):
        if any(parameter.requires_grad for parameter in layer.parameters()):
            return index
    return len(layers)


def active_dropout(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[str]:
    """Dropout that would make the frozen layers' output random in training: modules and config rates above 0."""
    found = [
        f"{type(module).__name__}(p={module.p})"
        for layer in layers
        for module in layer.modules()
        if isinstance(module, torch.nn.Dropout) and module.p > 0
    ]
    config = model.config.get_text_config()
    for name, value in config.to_dict().items():
        if "dropout" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{name}={value}")
    return found


class FrozenPrefixReplay:
    """The shared prefill and the frozen-layer replay of the module docstring, on one model; build it with
    `replay_frozen_prefix`. `shared_prefills` counts the generations whose prefill was shared, `shared_layers` the
    decoder layers the last shared prefill covered, `replayed` and `computed` the fused-head passes that used the
    recording and those that ran every layer."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList, first_trainable: int):
        self.model = model
        self.layers = layers
        self.first_trainable = first_trainable
        self.replayed = 0
        self.computed = 0
        self.shared_prefills = 0
        self.shared_layers = 0
        self.prefill_inverse: torch.Tensor | None = None
        self.recording: _Recording | None = None
        self.generating = False
        self.restore_model = None

    # ----------------------------------------------------------------------- install
    def attach(self) -> None:
        own = {name: vars(self.model)[name] for name in ("generate", "forward") if name in vars(self.model)}
        generate, forward = self.model.generate, self.model.forward

        # `generate()` reads the forward's signature to decide what to pass (logits_to_keep among others): keep it.
        @functools.wraps(generate)
        def recording_generate(*args, **kwargs):
            return self._generate(generate, *args, **kwargs)

        @functools.wraps(forward)
        def replaying_forward(*args, **kwargs):
            return self._forward(forward, *args, **kwargs)

        self.model.generate, self.model.forward = recording_generate, replaying_forward

        def restore():
            for name in ("generate", "forward"):
                if name in own:
                    setattr(self.model, name, own[name])
                else:
                    delattr(self.model, name)

        self.restore_model = restore

    def detach(self) -> None:
        if self.computed:
            logger.info(
                "Frozen-layer replay: %d of %d fused-head passes ran every layer (their sequences were not the last "
                "generate()'s).",
                self.computed,
                self.computed + self.replayed,
            )
        if self.restore_model is not None:
            self.restore_model()
            self.restore_model = None
        self.recording = None

    # ----------------------------------------------------------------------- recording
    def _frozen_version(self) -> int:
        return sum(
            parameter._version for layer in self.layers[: self.first_trainable] for parameter in layer.parameters()
        )

    @contextmanager
    def _first_trainable_inputs(self) -> Iterator[list[torch.Tensor]]:
        """The first trainable layer's input at each of its calls inside the block, detached; a call on the distinct
        rows of a shared prefill is copied out to every row."""
        inputs: list[torch.Tensor] = []

        def record(module, args, kwargs):
            hidden_states = args[0].detach() if args else kwargs["hidden_states"].detach()
            inverse = self.prefill_inverse
            if inverse is not None and hidden_states.shape[0] < inverse.shape[0]:
                hidden_states = hidden_states.index_select(0, inverse)
            inputs.append(hidden_states)

        handle = self.layers[self.first_trainable].register_forward_pre_hook(record, with_kwargs=True)
        try:
            yield inputs
        finally:
            handle.remove()

    def _generate(self, generate, *args, **kwargs):
        with self._first_trainable_inputs() as chunks:
            self.generating, self.recording = True, None
            shared = self._share_prefill(args, kwargs)
            try:
                output = generate(*args, **kwargs)
            finally:
                self.generating, self.prefill_inverse = False, None
                if shared is not None:
                    self._put_back(shared)
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        if sequences is None or not chunks:
            return output
        hidden_states = torch.cat(chunks, dim=1) if all(c.shape[0] == sequences.shape[0] for c in chunks) else None
        if hidden_states is not None and hidden_states.shape[1] == sequences.shape[1] - 1:
            self.recording = _Recording(sequences, hidden_states, self._frozen_version())
        return output

    def _share_prefill(self, args, kwargs) -> list[torch.nn.Module] | None:
        """Swap in `_SharedPrefill` for `generate()`'s first forward when prompts repeat (GRPO samples each prompt
        ``num_generations`` times) and no cache is handed in. It covers every decoder layer when none has active
        dropout, else the frozen ones. Returns the layers it stands in for (None when it is not swapped in)."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        given_cache = any(kwargs.get(name) is not None for name in ("past_key_values", "cache"))
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or given_cache:
            return None
        everything = list(self.layers)
        covered = everything if not active_dropout(self.model, everything) else everything[: self.first_trainable]
        attention = [
            getattr(getattr(layer, "self_attn", None), "layer_idx", index) for index, layer in enumerate(covered)
        ]
        if attention != list(range(len(covered))):
            return None
        attention_mask = kwargs.get("attention_mask")
        found = distinct_rows(input_ids, *([] if attention_mask is None else [attention_mask]))
        if found is None:
            return None
        first, inverse = found

        def back_to_the_layers(shared: bool):
            self._put_back(covered)
            if shared:
                self.shared_prefills += 1
                self.shared_layers = len(covered)
                self.prefill_inverse = inverse

        self.layers[0] = _SharedPrefill(covered, first, inverse, back_to_the_layers)
        for index in range(1, len(covered)):
            self.layers[index] = _StandIn()
        return covered

    def _put_back(self, layers: list[torch.nn.Module]) -> None:
        for index, layer in enumerate(layers):
            self.layers[index] = layer

    # ----------------------------------------------------------------------- replay
    def recorded_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The first trainable layer's input for ``input_ids`` ``[b, T]`` from the recording, or None when a row was
        not generated by the last `generate()` (compared at every position ``attention_mask`` keeps). The last column,
        never fed to the model by `generate()`, is zeros when it was not recorded."""
        recording = self.recording
        if recording is None or input_ids.dim() != 2 or recording.frozen_version != self._frozen_version():
            return None
        sequences = recording.sequences
        length = input_ids.shape[1]
        if length > sequences.shape[1] or input_ids.device != sequences.device:
            return None
        kept = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        same = (input_ids[:, None, :] == sequences[None, :, :length]) | ~kept[:, None, :]
        matches = same.all(dim=-1)
        if not bool(matches.any(dim=-1).all()):
            return None
        rows = matches.int().argmax(dim=-1)
        hidden_states = recording.hidden_states[rows, :length]
        if hidden_states.shape[1] < length:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, length - hidden_states.shape[1]))
        return hidden_states

    def _forward(self, forward, *args, **kwargs):
        replayable = kwargs.get("fused_lm_head") and kwargs.get("shift_labels") is None and not self.generating
        if not replayable:
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
        frozen = list(self.layers[: self.first_trainable])
        try:
            for index in range(self.first_trainable):
                self.layers[index] = _StandIn(hidden_states if index == 0 else None)
            return forward(*args, **kwargs)
        finally:
            self._put_back(frozen)

    def _recording_forward(self, forward, input_ids: torch.Tensor, args: tuple, kwargs: dict):
        """Run every layer, and keep the first trainable layer's input for the rows of ``input_ids``: a recording
        of its own, or more rows of the open one."""
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
    """`FrozenPrefixReplay` on ``model`` (the transformers model whose ``generate`` and fused-head ``forward`` TRL
    calls; for a PEFT model, ``model.get_base_model()``) inside the block, or None (and a log line saying why) when it
    cannot run there."""
    blockers = replay_blockers(model)
    if blockers:
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


class _RecordedInputs(torch.nn.Module):
    """Stands in for the first frozen layer over several forward calls: returns the next recorded input of the first
    trainable layer at each call, refusing one whose shape is not the call's."""

    def __init__(self, recorded: list[torch.Tensor]):
        super().__init__()
        self.recorded = list(recorded)

    def forward(self, hidden_states, *args, **kwargs):
        if not self.recorded:
            raise RuntimeError("frozen_layers_replaced: more forward calls than recorded inputs")
        recorded = self.recorded.pop(0)
        if recorded.shape != hidden_states.shape:
            raise RuntimeError(
                f"frozen_layers_replaced: a recorded input of shape {tuple(recorded.shape)} for a call of shape "
                f"{tuple(hidden_states.shape)}: the sequences are not the recorded ones"
            )
        return recorded


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def recording_first_trainable_input(model: torch.nn.Module) -> Iterator[list[torch.Tensor] | None]:
    """The input of ``model``'s first trainable decoder layer at each call inside the block, detached, in call order;
    None (and nothing recorded) when `replay_blockers` says the frozen layers cannot be skipped."""
    if replay_blockers(_unwrapped(model)):
        yield None
        return
    layers, _ = decoder_layers(_unwrapped(model))
    inputs: list[torch.Tensor] = []

    def record(module, args, kwargs):
        inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

    handle = layers[first_trainable_layer(layers)].register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield inputs
    finally:
        handle.remove()


@contextmanager
def frozen_layers_replaced(model: torch.nn.Module, recorded: list[torch.Tensor]) -> Iterator[None]:
    """Within, ``model``'s frozen bottom decoder layers are not run: the first trainable layer receives, call after
    call, the inputs `recording_first_trainable_input` recorded for the same sequences. For sequences read many times
    under different trainable weights (`stapo-trl counterfactual`): the frozen layers hold no trainable parameter and
    no active dropout, so their output is the recorded one."""
    layers, _ = decoder_layers(_unwrapped(model))
    first_trainable = first_trainable_layer(layers)
    frozen = list(layers[:first_trainable])
    try:
        for index in range(first_trainable):
            layers[index] = _RecordedInputs(recorded) if index == 0 else _StandIn(None)
        yield
    finally:
        for index, layer in enumerate(frozen):
            layers[index] = layer
