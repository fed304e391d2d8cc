"""The verl recipe runs the paper's setup of the TRL recipe beside it: the same batch arithmetic, lengths, optimizer,
clip range, sampling and S2T thresholds; and verl's own config (Hydra, then its dataclasses) accepts every key.

Both of verl's trainers are composed and pass the check verl's ``main`` runs before Ray starts (``validate_config``):
the v1 trainer (``trainer.use_v1=True``, verl's default, which the recipe states), whose modules import here because
the ``verl`` extra installs verl's ``verl-core`` extra (TransferQueue), and the v0 trainer. So is the recipe with the
paper's pool (trainer mode ``stapo_sync``)."""

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import verl  # noqa: E402
import yaml  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402

from stapo_trl.verl.actor_config import CheckedFSDPActorConfig  # noqa: E402
from stapo_trl.verl.losses import s2t_policy_loss  # noqa: E402
from stapo_trl.verl.pool_trainer import S2TPoolTrainer, check_pool_settings  # noqa: E402

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "dapo_math_17k" / "qwen3-1.7b-base"
VERL_RECIPE = RECIPES / "verl-stapo.sh"
TRL_RECIPE = RECIPES / "stapo.yaml"


def verl_overrides() -> list[str]:
    """The ``key=value`` arguments of the recipe's ``main_ppo`` command, as the shell passes them."""
    command = re.search(r"python3 -m verl\.trainer\.main_ppo(.*?)\"\$@\"", VERL_RECIPE.read_text(), re.DOTALL)
    arguments = shlex.split(command.group(1).replace("\\\n", " "))
    return [argument.replace("$DATA", "/data/dapo-math-17k.parquet") for argument in arguments]


POOL_ARGUMENTS = [
    "trainer.v1.trainer_mode=stapo_sync",
    "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
    "actor_rollout_ref.actor.calculate_entropy=False",
]
"""The arguments that the recipe's header gives for the paper's pool."""


def recipe_config(*extra_arguments: str):
    """verl's config composed with the recipe's arguments and then ``extra_arguments``, as ``main_ppo`` composes its
    command line (a later value of a key wins)."""
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=verl_overrides() + list(extra_arguments))


def passes_verl_s_start_up_check(config) -> bool:
    """verl's ``main`` validates the config (actor config dataclass included) before it starts Ray."""
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return True


@pytest.fixture(scope="module")
def verl_config():
    return recipe_config()


@pytest.fixture(scope="module")
def trl():
    return yaml.safe_load(TRL_RECIPE.read_text())


def test_verl_accepts_every_key(verl_config):
    actor = omega_conf_to_dataclass(verl_config.actor_rollout_ref.actor)
    actor.validate(n_gpus=verl_config.trainer.n_gpus_per_node, train_batch_size=verl_config.data.train_batch_size)
    assert type(actor) is CheckedFSDPActorConfig
    assert actor.policy_loss.loss_mode == "stapo"
    assert actor.calculate_entropy and actor.entropy_coeff == 0 and not actor.use_kl_loss
    assert actor.engine.entropy_checkpointing, "the engine reads entropy_checkpointing from fsdp_config"
    assert verl_config.trainer.use_v1 is True


def test_the_v1_trainer_that_the_recipe_runs_imports_and_composes(verl_config):
    import transfer_queue  # noqa: F401
    from verl.trainer.main_ppo import TaskRunnerV1  # noqa: F401
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ, PPOTrainerSync, get_trainer_cls

    assert passes_verl_s_start_up_check(verl_config)
    assert get_trainer_cls(verl_config.trainer.v1.trainer_mode) is PPOTrainerSync
    assert AgentLoopManagerTQ.__module__ == "verl.trainer.ppo.v1.agent_loop_tq"


def test_the_recipe_also_composes_for_the_v0_trainer():
    from verl.trainer.main_ppo_v0 import TaskRunner  # noqa: F401

    config = recipe_config("trainer.use_v1=False")
    assert config.trainer.use_v1 is False
    assert passes_verl_s_start_up_check(config)


def test_the_recipe_with_the_paper_s_pool_composes_and_picks_the_pool_trainer():
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = recipe_config(*POOL_ARGUMENTS)
    assert passes_verl_s_start_up_check(config)
    check_pool_settings(config)
    assert get_trainer_cls(config.trainer.v1.trainer_mode) is S2TPoolTrainer
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert (actor.policy_loss.loss_mode, actor.calculate_entropy) == ("vanilla", False)
    assert actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n == 512
    assert "trainer.v1.trainer_mode=stapo_sync" in VERL_RECIPE.read_text()


def test_the_batch_arithmetic_is_the_trl_recipe_s(verl_config, trl):
    actor, rollout, data = verl_config.actor_rollout_ref.actor, verl_config.actor_rollout_ref.rollout, verl_config.data
    gpus = verl_config.trainer.n_gpus_per_node * verl_config.trainer.nnodes
    assert gpus == trl["num_processes"]
    assert rollout.n == trl["num_generations"]
    generation = trl["per_device_train_batch_size"] * trl["num_processes"] * trl["steps_per_generation"]
    assert data.train_batch_size * rollout.n == generation == 256 * 8
    step = trl["per_device_train_batch_size"] * trl["num_processes"] * trl["gradient_accumulation_steps"]
    assert actor.ppo_mini_batch_size * rollout.n == step == 64 * 8
    assert actor.ppo_micro_batch_size_per_gpu == trl["per_device_train_batch_size"]
    assert actor.ppo_epochs == 1


def test_lengths_optimizer_clip_and_sampling_match(verl_config, trl):
    actor, rollout, data = verl_config.actor_rollout_ref.actor, verl_config.actor_rollout_ref.rollout, verl_config.data
    assert data.max_prompt_length == trl["max_prompt_tokens"]
    assert data.max_response_length == trl["max_completion_length"]
    assert actor.optim.lr == trl["learning_rate"]
    assert actor.optim.lr_warmup_steps == trl["warmup_steps"]
    assert actor.grad_clip == trl["max_grad_norm"]
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (trl["epsilon"], trl["epsilon_high"])
    assert (rollout.temperature, rollout.top_p) == (trl["temperature"], trl["top_p"])
    assert actor.loss_agg_mode == "token-mean" and trl["loss_type"] == "dapo"
    assert trl["beta"] == 0.0 and not verl_config.algorithm.use_kl_in_reward
    assert verl_config.algorithm.adv_estimator == "grpo"
    assert verl_config.actor_rollout_ref.model.path == trl["model_name_or_path"]


def test_the_registered_stapo_loss_uses_the_recipe_s_thresholds(trl):
    registered = get_policy_loss_fn("stapo")
    assert registered.func is s2t_policy_loss
    assert registered.keywords == {
        "prob_threshold": trl["prob_threshold"],
        "entropy_quantile": trl["entropy_quantile"],
    }


def test_the_recipe_says_it_was_not_run_on_a_gpu():
    assert "NOT RUN ON A GPU" in VERL_RECIPE.read_text()
