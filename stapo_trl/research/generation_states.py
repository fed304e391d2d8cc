"""Saved generation states (`GenerationStatesCallback`): what replays a generation's optimizer steps exactly, for
`stapo_trl.research.counterfactual`, under ``output_dir/generation_states/generation-<index>/`` (``start.pt``,
``step-<k>.pt``, and last ``generation.json``; docs/counterfactual.md). One process only."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.config import optimizer_steps_per_generation
from ..core.trl_seams import StepEventCallback
from ..file_and_metric_names import GENERATION_STATES_DIR, REWARDS_KEY
from ..storage import naming, write_text_atomically

GENERATION_FILE = "generation.json"
START_FILE = "start.pt"


@dataclass
class GenerationStatesArguments:
    """`GenerationStatesCallback`'s setting (a recipe key and flag of `stapo-trl train`)."""

    generation_states_every: int = field(
        default=0,
        metadata={
            "help": "Every this many generations (the first included), save what replays its optimizer steps under "
            "output_dir/generation_states/, for `stapo-trl counterfactual` (0: off); one process only. Disk: the "
            "trainable parameters 3 + (optimizer steps) times, plus the batches."
        },
    )

    def __post_init__(self) -> None:
        every = self.generation_states_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"generation_states_every must be an integer >= 0, got {every!r}.")


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that require gradients, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def capture_random_streams() -> dict[str, Any]:
    """torch's (CPU, initialized CUDA devices), NumPy's and Python's random states, as ``weights_only`` loads them."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": random.getstate(),
    }


def restore_random_streams(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _detached(batch: dict[str, Any]) -> dict[str, Any]:
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _save(value: Any, path: Path) -> None:
    staging = path.with_name(path.name + ".partial")
    with naming(staging):
        torch.save(value, staging)
    staging.replace(path)


class GenerationStateWriter:
    """Writes a run's saved states: `step_started` when an optimizer step starts (after the token rules),
    `micro_batch_started` before each micro-batch's loss, `step_ended` after the optimizer step."""

    def __init__(self, output_dir: str | Path, every: int, optimizer_steps_per_generation: int):
        self.root = Path(output_dir) / GENERATION_STATES_DIR
        self.every, self.steps_per_generation = every, optimizer_steps_per_generation
        self._pending: dict[str, Any] | None = None
        self._started: int | None = None  # the generation whose first step this process saved

    def step_started(self, global_step: int, model, optimizer, lr_scheduler, step_batches: list[dict]) -> None:
        generation, index = divmod(global_step, self.steps_per_generation)
        directory = self.root / f"generation-{generation:05d}"
        self._pending = None
        if generation % self.every:
            return
        if index == 0:
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir(parents=True)
            self._started = generation
            trainable = trainable_parameters(model)
            start = {"global_step": global_step, "trainable": trainable, "optimizer": optimizer.state_dict()}
            _save(start | {"lr_scheduler": lr_scheduler.state_dict()}, directory / START_FILE)
        elif self._started != generation:  # resumed inside it: its earlier steps were saved from other batches
            return
        self._pending = {"generation": generation, "index": index, "global_step": global_step}
        self._pending |= {"batches": [_detached(batch) for batch in step_batches], "random_states": []}

    def micro_batch_started(self) -> None:
        if self._pending is not None:
            self._pending["random_states"].append(capture_random_streams())

    def step_ended(self, model) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending["trainable_after"] = trainable_parameters(model)
        directory = self.root / f"generation-{pending['generation']:05d}"
        _save(pending, directory / f"step-{pending['index']}.pt")
        if pending["index"] == self.steps_per_generation - 1:
            summary = {
                "generation": pending["generation"],
                "first_global_step": pending["global_step"] - pending["index"],
                "optimizer_steps": self.steps_per_generation,
                "micro_batches_per_step": len(pending["batches"]),
                "completions_per_step": sum(int(batch["completion_ids"].size(0)) for batch in pending["batches"]),
            }
            write_text_atomically(directory / GENERATION_FILE, json.dumps(summary, indent=2) + "\n")


class GenerationStatesCallback(StepEventCallback):
    """Saves every ``generation_states_every``-th generation of a `STAPOTrainer` run (added by ``stapo-trl train``)."""

    def __init__(self, settings: GenerationStatesArguments):
        self.settings = settings
        self.writer: GenerationStateWriter | None = None

    def on_init_end(self, args, state, control, **kwargs):
        if not (getattr(args, "active_token_rules", None) or getattr(args, "shadow_token_rules", None)):
            raise ValueError(
                "generation_states_every saves the per-token p and H that a token rule reads, for replays under other "
                "selections, but no token rule is on or in shadow. For GRPO, add shadow_token_rules: [s2t]."
            )
        if args.world_size > 1 or args.deepspeed or args.fsdp:
            raise ValueError(
                "generation_states_every saves one process's batches and optimizer state, the whole step only in a "
                "one-process run without DeepSpeed or FSDP (a LoRA run on one GPU, say); or set it to 0."
            )

    def on_generation_scored(self, trainer, batch, rewards) -> None:
        if rewards is not None:
            batch[REWARDS_KEY] = rewards.detach().to(batch["completion_ids"].device)

    def on_step_tokens(self, trainer, step_batches, tokens) -> None:
        if self.writer is None:
            steps = optimizer_steps_per_generation(trainer.args)
            self.writer = GenerationStateWriter(trainer.args.output_dir, self.settings.generation_states_every, steps)
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.writer.step_started(
            trainer.state.global_step, model, trainer.optimizer, trainer.lr_scheduler, step_batches
        )

    def on_micro_batch(self, trainer, batch) -> None:
        if self.writer is not None:
            self.writer.micro_batch_started()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.writer is not None:
            self.writer.step_ended(model)


@dataclass
class SavedStep:
    """One optimizer step of a saved generation."""

    global_step: int
    batches: list[dict[str, Any]]
    random_states: list[dict[str, Any]]
    trainable_after: dict[str, torch.Tensor]


@dataclass
class SavedGeneration:
    """A complete saved generation (its ``generation.json`` read)."""

    directory: Path
    generation: int
    first_global_step: int
    optimizer_steps: int

    def start(self) -> dict[str, Any]:
        return torch.load(self.directory / START_FILE, weights_only=True)

    def step(self, index: int) -> SavedStep:
        saved = torch.load(self.directory / f"step-{index}.pt", weights_only=True)
        return SavedStep(saved["global_step"], saved["batches"], saved["random_states"], saved["trainable_after"])


def saved_generations(run_dir: str | Path) -> list[SavedGeneration]:
    """The complete saved generations of a run, in order (incomplete ones, without ``generation.json``, left out)."""
    found = []
    for marker in sorted((Path(run_dir) / GENERATION_STATES_DIR).glob(f"generation-*/{GENERATION_FILE}")):
        values = json.loads(marker.read_text())
        fields = (values["generation"], values["first_global_step"], values["optimizer_steps"])
        found.append(SavedGeneration(marker.parent, *fields))
    return found
