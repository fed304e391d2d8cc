"""The verl details the plugin relies on still hold in the installed verl (``stapo_trl.verl.drift``), and each
check fails, by name, when its detail moves."""

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

from stapo_trl.verl import drift  # noqa: E402


@pytest.mark.parametrize("dependency", drift.DEPENDENCIES, ids=lambda dependency: dependency.name)
def test_the_installed_verl_fits(dependency):
    assert dependency.check() == []


def test_a_ppo_loss_that_computes_no_entropy_is_reported(monkeypatch):
    original = drift.ppo_loss

    def without_entropy(config, model_output, data, dp_group=None):
        return original(config, {"log_probs": model_output["log_probs"]}, data, dp_group)

    monkeypatch.setattr(drift, "ppo_loss", without_entropy)
    (problem,) = drift.check_entropy_local()
    assert "calculate_entropy=True" in problem


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
