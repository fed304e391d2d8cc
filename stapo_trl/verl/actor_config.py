"""verl's FSDP actor config with the plugin's start-up checks, run on the driver before Ray starts and in every actor
worker: ``actor_rollout_ref.actor._target_=stapo_trl.verl.actor_config.CheckedFSDPActorConfig`` (docs/verl.md).
Importing it registers the plugin's loss modes whatever ``VERL_USE_EXTERNAL_PLUGINS`` says."""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.config import FSDPActorConfig

from .losses import SILENCING_LOSS_MODES
from .mini_batch_pool import POOL_TRAINER_MODES


def check_actor_settings(actor: Any) -> None:
    """Raise a ValueError that says what to change when verl's actor config cannot run the chosen loss."""
    loss_mode = actor.policy_loss.loss_mode
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not a policy loss verl knows in this "
            f"process (it knows {', '.join(sorted(POLICY_LOSS_REGISTRY))}). stapo-trl registers stapo, stare, "
            "stare_c2 and the names given to register_s2t_loss or register_stare_loss in a module verl imports. "
            "Install stapo-trl with its verl extra in the environment of every node (pip install -e '.[verl]' in a "
            "clone of stapo-trl; docs/verl.md), and check the name."
        )
    if loss_mode not in SILENCING_LOSS_MODES:
        return
    if not actor.calculate_entropy and actor.entropy_coeff == 0:
        raise ValueError(
            f"loss_mode={loss_mode} reads the per-token entropy, which verl's actor update computes only with "
            "actor_rollout_ref.actor.calculate_entropy=True (or a nonzero entropy_coeff): set calculate_entropy=True "
            "(entropy_coeff stays 0, so the loss is unchanged)."
        )
    sequence_parallel = getattr(actor.engine, "ulysses_sequence_parallel_size", 1)
    if sequence_parallel > 1:
        raise ValueError(
            f"loss_mode={loss_mode} pools its candidates over the data-parallel ranks, and Ulysses sequence "
            f"parallelism ({sequence_parallel}) splits each sequence over several processes. Run it with data "
            "parallelism only, or use trainer.v1.trainer_mode=stapo_sync with loss_mode=vanilla, whose mask is "
            "taken on verl's driver."
        )


def check_trainer_settings(config: Any) -> None:
    """Refuse a pool trainer mode that this run would not use: verl's v0 trainer (``trainer.use_v1=False``) ignores it,
    and without verl's v1 trainer (a verl without TransferQueue) it cannot be built."""
    if (mode := OmegaConf.select(config, "trainer.v1.trainer_mode")) not in POOL_TRAINER_MODES:
        return
    alternative = (
        "For S2T on this trainer, use the per-micro-batch loss instead: actor_rollout_ref.actor.policy_loss.loss_mode="
        "stapo with actor_rollout_ref.actor.calculate_entropy=True (docs/verl.md)."
    )
    if not OmegaConf.select(config, "trainer.use_v1", default=True):
        raise ValueError(
            f"trainer.v1.trainer_mode={mode} is the S2T pool over whole mini-batches, which exists only in verl's v1 "
            "trainer, and trainer.use_v1=False selects verl's v0 trainer, which ignores trainer_mode: the run would "
            f"train with no mask. Set trainer.use_v1=True. {alternative}"
        )
    for module in ("transfer_queue", "verl.trainer.ppo.v1.trainer_sync"):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(
                f"trainer.v1.trainer_mode={mode} subclasses verl's v1 trainer, which this verl cannot provide: "
                f"importing {module} fails ({error}). The pool trainer supports verl 0.9.1 with its verl-core extra "
                f"(pip install -e '.[verl]'). {alternative}"
            ) from error


class CheckedFSDPActorConfig(FSDPActorConfig):
    """verl's ``FSDPActorConfig``, plus :func:`check_actor_settings` when it is built and
    :func:`check_trainer_settings` when verl validates it on the driver."""

    def __post_init__(self):
        super().__post_init__()
        check_actor_settings(self)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: Any = None):
        super().validate(n_gpus, train_batch_size, model_config)
        if isinstance(model_config, DictConfig):
            check_trainer_settings(model_config._get_root())
