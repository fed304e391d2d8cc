"""STARE's closed-loop controller (arXiv 2606.19236, §4.3-4.4), updated once per generation with the batch's mean token
entropy under the generating policy: the gate (reweighting on while that entropy is strictly below the target; it
starts on) and the optional adaptive W/M schedule. Its state is training state, saved with each checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

GATE_MODES = ("entropy", "on", "off")
STARE_STATE_FILE = "stare_controller_state.json"
"""STARE's controller state, in each checkpoint."""
STATE_KEYS = ("gate_on", "positive_weight", "negative_weight", "batch_entropy", "num_updates")


def _sign(value: float) -> float:
    return float((value > 0) - (value < 0))


@dataclass
class STAREController:
    target_entropy: float = 0.3
    positive_weight: float = 1.1
    negative_weight: float = 0.9
    adaptive: bool = False
    alpha: float = 0.01
    max_positive_weight: float = 1.5
    min_negative_weight: float = 0.5
    gate_mode: str = "entropy"
    gate_on: bool = True
    batch_entropy: float = math.nan
    num_updates: int = 0

    def __post_init__(self):
        if self.gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {self.gate_mode!r}.")
        if self.gate_mode != "entropy":
            self.gate_on = self.gate_mode == "on"

    def update(self, batch_entropy: float) -> None:
        """Move the gate, and W and M when adaptive, from one batch's mean token entropy (in nats)."""
        if not math.isfinite(batch_entropy):
            return
        self.batch_entropy = float(batch_entropy)
        self.num_updates += 1
        if self.gate_mode == "entropy":
            self.gate_on = batch_entropy < self.target_entropy
        if self.adaptive and self.alpha > 0:
            step = self.alpha * _sign(self.target_entropy - batch_entropy)
            self.positive_weight = min(max(self.positive_weight + step, 1.0), self.max_positive_weight)
            self.negative_weight = min(max(self.negative_weight - step, self.min_negative_weight), 1.0)

    def metrics(self) -> dict[str, float]:
        """What the trainer logs each optimizer step, under ``stare/<key>``."""
        return {
            "positive_weight": self.positive_weight,
            "negative_weight": self.negative_weight,
            "batch_entropy": self.batch_entropy,
        }

    def state_dict(self) -> dict[str, float | int | bool | None]:
        state = {key: value for key, value in asdict(self).items() if key in STATE_KEYS}
        if not math.isfinite(state["batch_entropy"]):
            state["batch_entropy"] = None  # JSON has no NaN
        return state

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"STARE controller state lacks {missing}; it has {sorted(state)}.")
        self.gate_on = bool(state["gate_on"]) if self.gate_mode == "entropy" else self.gate_mode == "on"
        self.positive_weight = float(state["positive_weight"])
        self.negative_weight = float(state["negative_weight"])
        self.batch_entropy = math.nan if state["batch_entropy"] is None else float(state["batch_entropy"])
        self.num_updates = int(state["num_updates"])

    def save_to(self, directory: str | os.PathLike) -> None:
        """Write the state into a checkpoint directory (`STARE_STATE_FILE`), through a temporary file flushed to the
        storage and a rename, so that a resume after a crash reads the old state or the new, never a file cut short."""
        path = os.path.join(directory, STARE_STATE_FILE)
        with open(path + ".partial", "w", encoding="utf-8") as file:
            file.write(json.dumps(self.state_dict(), indent=2) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(path + ".partial", path)

    def restore_from(self, checkpoint: str | os.PathLike) -> None:
        """Restore the state saved in ``checkpoint``. A checkpoint without it (not saved by a STARE run) leaves the
        configured state, with a warning. Without ``adaptive`` the configured W and M win over saved ones that differ,
        with a warning."""
        path = os.path.join(checkpoint, STARE_STATE_FILE)
        if not os.path.exists(path):
            logger.warning(
                "Resuming from %s, which has no %s (it was not saved by a STARE run); the STARE controller starts "
                "from the configured W=%s, M=%s with the gate on.",
                checkpoint,
                STARE_STATE_FILE,
                self.positive_weight,
                self.negative_weight,
            )
            return
        with open(path) as file:
            state = json.load(file)
        configured = (self.positive_weight, self.negative_weight)
        self.load_state_dict(state)
        restored = (self.positive_weight, self.negative_weight)
        if not self.adaptive and restored != configured:
            logger.warning(
                "The checkpoint's STARE weights W=%s, M=%s differ from the configured W=%s, M=%s; with "
                "stare_adaptive=False the configured ones are used.",
                *restored,
                *configured,
            )
            self.positive_weight, self.negative_weight = configured
