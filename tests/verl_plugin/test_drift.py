"""The verl details the plugin relies on still hold in the installed verl (``stapo_trl.verl.drift``), and each
check fails, by name, when its detail moves."""

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402

from stapo_trl.verl import drift  # noqa: E402


@pytest.mark.parametrize("dependency", drift.DEPENDENCIES, ids=lambda dependency: dependency.name)
def test_the_installed_verl_fits(dependency):
    assert dependency.check() == []


def test_a_ppo_loss_that_computes_no_entropy_is_reported(monkeypatch):
    original = drift.ppo_loss

    def without_entropy(config, model_output, data, dp_group=None):
        return original(config, {"log_probs": model_output["log_probs"]}, data, dp_group)

    monkeypatch.setattr(drift, "ppo_loss", without_entropy)
    problems = drift.check_entropy_local()
    assert [problem.split(":")[0] for problem in problems] == ["v0 layout", "v1 layout"]
    assert all("calculate_entropy=True" in problem for problem in problems)


def test_a_policy_loss_called_with_other_arguments_is_reported(monkeypatch):
    monkeypatch.setattr(drift, "POLICY_LOSS_ARGUMENTS", (*drift.POLICY_LOSS_ARGUMENTS, "entropy"))
    (problem,) = drift.check_policy_loss_call()
    assert "not (" in problem


def test_another_verl_version_is_reported(monkeypatch):
    monkeypatch.setattr(drift, "TESTED_VERL", "0.0.1")
    (problem,) = drift.check_version()
    assert "tested on 0.0.1" in problem


def test_the_command_prints_every_check(capsys):
    assert drift.main() == 0
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines() if not line.startswith(" ")] == [
        f"ok   {dependency.name}" for dependency in drift.DEPENDENCIES
    ]


def test_a_driver_that_calls_the_update_otherwise_is_reported(monkeypatch):
    class MovedUpdate(drift.PPOTrainer):
        def _update_actor(self, batch, metrics, epoch):
            return batch

    monkeypatch.setattr(drift, "PPOTrainer", MovedUpdate)
    problems = drift.check_pool_trainer_hooks()
    assert "PPOTrainer._update_actor(self, batch, metrics, epoch) changed its arguments" in problems[0]
    assert "no longer contains self.actor_rollout_wg.update_actor(batch)" in problems[1]


def test_another_split_into_mini_batches_is_reported(monkeypatch):
    monkeypatch.setattr(drift, "optimizer_step_rows", lambda rows, dp, mini: list(torch.arange(rows).split(mini)))
    problems = drift.check_pool_trainer_hooks()
    assert problems and all("splits 24 rows" in problem for problem in problems)


def test_an_actor_config_built_elsewhere_is_reported(monkeypatch):
    monkeypatch.setattr(drift, "validate_config", lambda config, use_reference_policy, use_critic: None)
    (problem,) = drift.check_actor_config_built_at_start_up()
    assert "no longer contains omega_conf_to_dataclass(config.actor_rollout_ref.actor)" in problem
