"""Applying a saved optimizer step again, from its saved state, with other tokens silenced, through the trainer's own
code (`STAPOTrainer.set_kept_tokens`, ``training_step`` from each micro-batch's saved random state, transformers'
clipping and optimizer step): with nothing silenced it reproduces the recorded update bit for bit."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch

from ...core.token_stats.statistics import restored_random_streams
from ...cpu.frozen_layer_replay import frozen_layers_replaced, recording_first_trainable_input
from ..generation_states import SavedStep, restore_random_streams, trainable_parameters


def restore_start(trainer, start: dict[str, Any]) -> None:
    """Put the trainer's model, optimizer and scheduler where a saved generation started; ``start`` is not modified.
    Its trainable parameters' names must be exactly the model's."""
    model, values = trainer.accelerator.unwrap_model(trainer.model), start["trainable"]
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(parameters) != set(values):
        missing, unexpected = sorted(set(parameters) - set(values)), sorted(set(values) - set(parameters))
        raise ValueError(
            "The saved state's trainable parameters are not the model's (was the run's recipe or model changed?): "
            f"{len(missing)} missing (first: {missing[:1]}), {len(unexpected)} not in the model (first: "
            f"{unexpected[:1]})."
        )
    with torch.no_grad():
        for name, value in values.items():
            parameters[name].copy_(value)
    trainer.optimizer.load_state_dict(copy.deepcopy(start["optimizer"]))
    trainer.lr_scheduler.load_state_dict(copy.deepcopy(start["lr_scheduler"]))
    trainer.model.zero_grad(set_to_none=True)


def snapshot(trainer) -> dict[str, Any]:
    """A copy of the trainer's state now, in the form of a saved generation's start (for `restore_start`)."""
    return {
        "trainable": trainable_parameters(trainer.accelerator.unwrap_model(trainer.model)),
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "lr_scheduler": copy.deepcopy(trainer.lr_scheduler.state_dict()),
    }


def record_frozen_inputs(trainer, step: SavedStep) -> list[list[torch.Tensor]] | None:
    """The first trainable layer's inputs in TRL's loss over each micro-batch of ``step`` (a list per micro-batch, a
    tensor per forward), for `replay_step` to skip the frozen layers; None when they cannot be skipped."""
    batches = [dict(batch) for batch in step.batches]
    nothing = torch.zeros_like(torch.cat([batch["completion_mask"] for batch in batches]), dtype=torch.bool)
    trainer.set_kept_tokens(batches, nothing)
    trainer.current_gradient_accumulation_steps = len(batches)
    model = trainer.model.train()
    recorded = []
    with restored_random_streams(), trainer.metrics_untouched(), torch.no_grad():
        for batch in batches:
            with recording_first_trainable_input(model) as inputs:
                trainer.compute_loss(model, batch)
            if inputs is None:
                return None
            recorded.append(inputs)
    return recorded


def replay_step(
    trainer, step: SavedStep, silenced: torch.Tensor, frozen_inputs: list[list[torch.Tensor]] | None = None
) -> float:
    """Apply ``step`` again from the trainer's current state with ``silenced`` (bool, the step's micro-batches' rows
    concatenated) removed from the loss; with ``frozen_inputs`` (`record_frozen_inputs`) the frozen layers are not
    run. The saved batches are not modified. Returns the gradient norm before clipping, as transformers logs it (NaN
    without clipping)."""
    batches = [dict(batch) for batch in step.batches]
    trainer.set_kept_tokens(batches, silenced)
    model = trainer.model
    trainer.current_gradient_accumulation_steps = len(batches)
    with trainer.micro_batches_as_given(), trainer.metrics_untouched():
        for index, (batch, random_state) in enumerate(zip(batches, step.random_states, strict=True)):
            restore_random_streams(random_state)
            replaced = nullcontext() if frozen_inputs is None else frozen_layers_replaced(model, frozen_inputs[index])
            with replaced:
                trainer.training_step(model, batch, None)
    grad_norm = float("nan")
    if trainer.args.max_grad_norm is not None and trainer.args.max_grad_norm > 0:
        grad_norm = float(trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm))
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    return grad_norm
