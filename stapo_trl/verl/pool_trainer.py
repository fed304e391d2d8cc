"""The trainer mode ``stapo_sync``: verl's v1 sync trainer whose driver's ``_update_actor`` removes the tokens S2T
silences, with ``tau_h`` over each whole optimizer step (:mod:`.mini_batch_pool`), from ``response_mask`` and
``loss_mask`` for the update; verl's sync trainer in every other branch (docs/verl-internals.md, "The whole
mini-batch as the pool")."""

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

CHECKED_ACTOR_CONFIG = "stapo_trl.verl.actor_config.CheckedFSDPActorConfig"
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
    values: dict[str, list[float]] = {}
    for stats in step_stats:
        for name, value in s2t_metrics(stats).items():
            values.setdefault(name, []).append(value)
    return {name: math.fsum(values[name]) / len(values[name]) for name in sorted(values)}


class S2TPoolTrainer(PPOTrainerSync):
    """verl's ``PPOTrainerSync`` whose actor update trains on the tokens that the whole-mini-batch S2T mask keeps."""

    keep_rule = s2t_keep_rule()
    """S2T with the paper's thresholds; :func:`register_s2t_pool_trainer` registers others."""

    registered_mode: str | None = None
    """The ``trainer.v1.trainer_mode`` that selected this trainer."""

    @property
    def trainer_mode(self) -> str:
        """``"sync"``: verl's v1 trainer compares this attribute with ``"sync"`` to take its sync branches
        (``verl/trainer/ppo/v1/trainer_base.py`` lines 129 to 1499, listed in docs/verl-internals.md)."""
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, name: str) -> None:
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
        actor_rollout_ref = self.config.actor_rollout_ref
        mini_batch_size = actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n
        mask = whole_step_keep(
            padded["old_log_probs"],
            padded["entropy"],
            padded["advantages"],
            padded["response_mask"],
            optimizer_step_rows(len(batch), self._actor_dp_size(), mini_batch_size),
            self.keep_rule,
        )
        silenced = {
            name: response_to_nested((padded[name] * mask.keep).to(padded[name].dtype), fields["response_mask"])
            for name in MASK_FIELDS
        }
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=TensorDict(silenced, batch_size=len(batch)))
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


register_trainer("stapo_sync")(S2TPoolTrainer)
