"""verl's v1 sync trainer with STAPO's S2T mask pooled over each whole mini-batch: the trainer mode ``stapo_sync``
(``trainer.v1.trainer_mode=stapo_sync``, with a ``loss_mode`` that does not mask, such as ``vanilla``; docs/verl.md).

Before each actor update it reads the whole batch's old log-probabilities, entropies, advantages and masks from the
driver, takes S2T's mask with ``tau_h`` over each optimizer step's rows (:mod:`.mini_batch_pool`), removes the
silenced tokens from ``response_mask`` and ``loss_mask`` for the update, and writes both back afterwards. It overrides
only the driver's ``_update_actor`` (checked by :mod:`.drift`).

Everything else is verl's sync trainer: verl takes its sync branches by comparing ``trainer_mode`` with ``"sync"``
(``verl/trainer/ppo/v1/trainer_base.py``: set at line 129, read for the replay buffer at 130 and 153, the dataloader's
generation batch size at 731, TransferQueue state in checkpoints at 902, 912 and 1004, and the prompt fields stored in
TransferQueue at 1499), and the subclass's ``trainer_mode`` reads ``"sync"`` whatever name registered it. Needs verl's
``verl-core`` extra (TransferQueue); the ``stapo_trl_trainer`` entry point of ``verl.plugins``.
"""

from __future__ import annotations

import math
from typing import Any

import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from .losses import SILENCING_LOSS_MODES, s2t_keep_rule, s2t_metrics
from .mini_batch_pool import POOL_TRAINER_MODES, optimizer_step_rows, whole_step_keep

POOL_TRAINER_MODE = "stapo_sync"
CHECKED_ACTOR_CONFIG = "stapo_trl.verl.actor_config.CheckedFSDPActorConfig"
SYNC_MODE = "sync"
"""The mode name verl's v1 trainer compares with to take its sync branches."""
POOL_FIELDS = ("old_log_probs", "entropy", "advantages", "response_mask", "loss_mask")
MASK_FIELDS = ("response_mask", "loss_mask")


def check_pool_settings(config: Any) -> None:
    """Refuse, before any rollout, the settings under which the whole-mini-batch pool would be wrong or double."""
    actor = config.actor_rollout_ref.actor
    problems = []
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode in SILENCING_LOSS_MODES:
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} masks each micro-batch again; with this "
            "trainer mode use a loss that does not mask, such as vanilla"
        )
    if actor.get("shuffle", False):
        problems.append(
            "actor_rollout_ref.actor.shuffle=True shuffles each rank's rows into mini-batches on the workers, so the "
            "driver cannot know each optimizer step's rows: set it to False"
        )
    if actor.get("_target_") != CHECKED_ACTOR_CONFIG:
        problems.append(
            f"it needs actor_rollout_ref.actor._target_={CHECKED_ACTOR_CONFIG}, whose check on verl's driver stops a "
            "run that would train without the pool (trainer.use_v1=False ignores the trainer mode) before Ray starts"
        )
    correction = config.algorithm.get("rollout_correction", None)
    if correction is not None and correction.get("bypass_mode", False):
        problems.append(
            "algorithm.rollout_correction.bypass_mode=True uses the rollout's log-probabilities as the old ones and "
            "computes no entropy, which the mask needs: turn bypass mode off"
        )
    if problems:
        raise ValueError(f"trainer.v1.trainer_mode={config.trainer.v1.trainer_mode}: " + "; ".join(problems) + ".")


def mean_over_steps(step_stats: list[dict[str, float | int]]) -> dict[str, float]:
    """The S2T statistics as ``actor/s2t/`` metrics, each the mean over the optimizer steps where it is defined."""
    per_step = [s2t_metrics(stats) for stats in step_stats]
    names = sorted({name for metrics in per_step for name in metrics})
    means = {}
    for name in names:
        values = [metrics[name] for metrics in per_step if name in metrics]
        means[name] = math.fsum(values) / len(values)
    return means


class S2TPoolTrainer(PPOTrainerSync):
    """verl's ``PPOTrainerSync`` whose actor update trains on the tokens that the whole-mini-batch S2T mask keeps."""

    keep_rule = s2t_keep_rule()
    """S2T with the paper's thresholds; :func:`register_s2t_pool_trainer` registers others."""

    registered_mode: str | None = None
    """The ``trainer.v1.trainer_mode`` that selected this trainer."""

    @property
    def trainer_mode(self) -> str:
        """``"sync"``: verl's v1 trainer compares this attribute with ``"sync"`` to take its sync branches (see the
        module docstring), which this trainer takes in every respect but the mask."""
        return SYNC_MODE

    @trainer_mode.setter
    def trainer_mode(self, name: str) -> None:
        # verl's PPOTrainer.__init__ assigns the configured mode's name here; it is kept, and reads stay "sync".
        self.registered_mode = name

    def __init__(self, config):
        check_pool_settings(config)
        super().__init__(config)

    def _actor_dp_size(self) -> int:
        """The actor's data-parallel size, read as verl's ``_balance_batch`` reads it."""
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        return max(worker_group._dispatch_info["actor"]) + 1

    def _update_actor(self, batch, metrics: dict):
        keys, partition_id = batch.keys, batch.partition_id
        fields = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=list(POOL_FIELDS))
        padded = fields.to_padded_tensor()
        mini_batch_size = (
            self.config.actor_rollout_ref.actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
        )
        mask = whole_step_keep(
            padded["old_log_probs"],
            padded["entropy"],
            padded["advantages"],
            padded["response_mask"],
            optimizer_step_rows(len(batch), self._actor_dp_size(), mini_batch_size),
            self.keep_rule,
        )
        silenced_masks = TensorDict(
            {
                name: response_to_nested((padded[name] * mask.keep).to(padded[name].dtype), fields["response_mask"])
                for name in MASK_FIELDS
            },
            batch_size=len(batch),
        )
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=silenced_masks)
        try:
            updated = super()._update_actor(batch, metrics)
        finally:
            tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields.select(*MASK_FIELDS))
        metrics.update(mean_over_steps(mask.step_stats))
        return updated


def register_s2t_pool_trainer(name: str, **thresholds):
    """Register :class:`S2TPoolTrainer` as verl's v1 trainer mode ``name``, with S2T's thresholds given as
    :func:`~stapo_trl.verl.losses.register_s2t_loss` takes them (``prob_threshold``, ``entropy_quantile``)."""
    trainer = type(
        f"S2TPoolTrainer_{name}",
        (S2TPoolTrainer,),
        {"keep_rule": s2t_keep_rule(**thresholds), "__module__": __name__},
    )
    POOL_TRAINER_MODES.add(name)
    return register_trainer(name)(trainer)


register_trainer(POOL_TRAINER_MODE)(S2TPoolTrainer)
