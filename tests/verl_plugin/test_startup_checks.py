"""A run that cannot use the plugin stops at start-up, before any rollout, with a message that says what to change.

verl builds the actor config dataclass from ``actor_rollout_ref.actor`` (``omega_conf_to_dataclass``) on the driver,
in ``validate_config`` before Ray starts, and in every actor worker as the first step of ``init_model``, which the v1
trainer calls in its set-up, before its first rollout. The recipe names stapo-trl's ``CheckedFSDPActorConfig`` there,
so each of those calls imports stapo-trl and runs its checks; Hydra reports a failed check as an
``InstantiationException`` that quotes the check's message. A process without stapo-trl is simulated here by hiding
the package from Python's import system for the duration of the call.
"""

import importlib.abc
import sys
from contextlib import contextmanager

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

from hydra.errors import InstantiationException  # noqa: E402
from test_verl_recipe import recipe_config  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402

from stapo_trl.verl.actor_config import CheckedFSDPActorConfig  # noqa: E402

TARGET = "stapo_trl.verl.actor_config.CheckedFSDPActorConfig"


class NotInstalled(importlib.abc.MetaPathFinder):
    """Answers an import of ``stapo_trl`` as Python does where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "stapo_trl" or name.startswith("stapo_trl."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@contextmanager
def stapo_trl_not_installed():
    hidden = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "stapo_trl"}
    for name in hidden:
        del sys.modules[name]
    finder = NotInstalled()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(hidden)


def worker_builds_the_actor_config(config):
    """What an actor worker's ``init_model`` does first with the actor section (engine_workers.py)."""
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def driver_checks_the_config(config):
    """What verl's ``main`` runs before it starts Ray (main_ppo.py)."""
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


@pytest.mark.parametrize("start_up", [worker_builds_the_actor_config, driver_checks_the_config])
def test_a_process_without_stapo_trl_stops_at_start_up_naming_it(start_up):
    config = recipe_config()
    with stapo_trl_not_installed(), pytest.raises(Exception, match=f"Error locating target '{TARGET}'") as stopped:
        start_up(config)
    chained = []
    error = stopped.value
    while error is not None:
        chained.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("No module named 'stapo_trl" in message for message in chained), chained
    assert type(worker_builds_the_actor_config(config)) is CheckedFSDPActorConfig


@pytest.mark.parametrize("start_up", [worker_builds_the_actor_config, driver_checks_the_config])
def test_a_loss_mode_verl_does_not_know_stops_at_start_up(start_up):
    config = recipe_config("actor_rollout_ref.actor.policy_loss.loss_mode=stapo_q75")
    with pytest.raises(
        InstantiationException, match=r"loss_mode='stapo_q75' is not a policy loss verl knows.*pip install -e"
    ):
        start_up(config)


def test_stapo_without_calculate_entropy_stops_at_start_up():
    config = recipe_config("actor_rollout_ref.actor.calculate_entropy=False")
    with pytest.raises(
        InstantiationException, match=r"loss_mode=stapo reads the per-token entropy.*calculate_entropy=True"
    ):
        worker_builds_the_actor_config(config)
    assert worker_builds_the_actor_config(recipe_config("actor_rollout_ref.actor.entropy_coeff=0.001"))


def test_stapo_with_sequence_parallelism_stops_at_start_up():
    config = recipe_config("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    with pytest.raises(InstantiationException, match=r"Ulysses sequence parallelism \(2\).*trainer_mode=stapo_sync"):
        worker_builds_the_actor_config(config)


def test_without_the_plugin_the_trainer_mode_is_unknown_to_the_v1_task_runner(monkeypatch):
    """Trainer mode ``stapo_sync`` runs only on the driver. Where the plugin's trainer entry point did not load, the
    v1 task runner's first step, ``get_trainer_cls``, stops the run."""
    monkeypatch.delitem(TRAINER_REGISTRY, "stapo_sync")
    with pytest.raises(ValueError, match=r"Unknown trainer 'stapo_sync'\. Available trainers: .*sync"):
        get_trainer_cls("stapo_sync")


POOL = ["trainer.v1.trainer_mode=stapo_sync", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"]


def test_the_pool_trainer_mode_with_the_v0_trainer_stops_before_ray_starts():
    """verl's v0 trainer ignores ``trainer.v1.trainer_mode``: with ``use_v1=False`` the run would train with no mask.
    verl's own check before Ray starts calls the checked actor config's ``validate`` with a node of the whole config."""
    config = recipe_config(*POOL, "trainer.use_v1=False")
    with pytest.raises(ValueError, match=r"trainer.use_v1=False selects verl's v0 trainer.*Set trainer.use_v1=True"):
        driver_checks_the_config(config)
    driver_checks_the_config(recipe_config(*POOL))  # use_v1=True, the recipe's: passes
    driver_checks_the_config(recipe_config("trainer.use_v1=False"))  # the per-micro-batch loss on v0: passes


def test_the_pool_trainer_mode_without_verl_s_v1_trainer_names_the_per_micro_batch_loss(monkeypatch):
    """verl's next trainer (its ``neo`` branch) has no TransferQueue and no v1 trainer; simulated here by an import of
    TransferQueue that fails."""
    import stapo_trl.verl.actor_config as actor_config

    real_import = actor_config.importlib.import_module

    def without_transfer_queue(name, *args):
        if name == "transfer_queue":
            raise ModuleNotFoundError("No module named 'transfer_queue'")
        return real_import(name, *args)

    monkeypatch.setattr(actor_config.importlib, "import_module", without_transfer_queue)
    with pytest.raises(ValueError, match=r"importing transfer_queue fails.*verl 0\.9\.1.*loss_mode=stapo"):
        driver_checks_the_config(recipe_config(*POOL))
    driver_checks_the_config(recipe_config())  # the per-micro-batch loss needs no v1 trainer: passes


def test_the_per_micro_batch_loss_registers_without_transfer_queue_or_the_v1_trainer():
    """What the plugin keeps on a verl without the v1 trainer: the loss modes, whose module imports neither."""
    import subprocess

    script = (
        "import sys\n"
        "sys.modules['transfer_queue'] = None\n"
        "sys.modules['verl.trainer.ppo.v1'] = None\n"
        "import stapo_trl.verl.losses\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "assert {'stapo', 'stare', 'stare_c2'} <= set(POLICY_LOSS_REGISTRY), sorted(POLICY_LOSS_REGISTRY)\n"
        "print('registered')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "registered" in result.stdout


def test_the_pool_trainer_mode_needs_the_checked_actor_config():
    from stapo_trl.verl.pool_trainer import S2TPoolTrainer

    config = recipe_config(*POOL, "actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig")
    with pytest.raises(ValueError, match=r"needs actor_rollout_ref.actor._target_=stapo_trl.verl.actor_config"):
        S2TPoolTrainer(config)
