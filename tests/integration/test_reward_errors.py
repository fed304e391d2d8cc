"""Blame where it belongs: the user's reward function raising, or returning the wrong number of rewards or infinite
ones, is reported as that function's doing, with the step."""

import logging
import math
import re

import pytest
from tiny import build_char_tokenizer, build_tiny_qwen3, count_vowels_reward, prompt_dataset, tiny_config

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.rewards.blame import InfiniteRewardWarningCallback, reward_function_error


def grader_offline(completions, **kwargs):
    raise ConnectionError("grader at 10.0.0.7 unreachable")


class CallableGrader:
    def __call__(self, completions, **kwargs):
        return [1.0 / 0 for _ in completions]


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def infinite_first(completions, **kwargs):
    return [math.inf] + [0.0] * (len(completions) - 1)


def trainer_with(tmp_path, reward):
    tokenizer = build_char_tokenizer()
    return STAPOTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=reward,
        args=tiny_config(STAPOConfig, tmp_path, max_steps=1),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
        callbacks=[InfiniteRewardWarningCallback()],
    )


def blamed(trainer, cause):
    """What `stapo-trl train` reports for the exception ``trainer.train()`` raises (`reward_function_error`)."""
    with pytest.raises(cause) as raised:
        trainer.train()
    step = trainer.state.global_step + 1
    return raised.value, reward_function_error(raised.value, trainer.reward_funcs, trainer.reward_func_names, step)


@pytest.mark.parametrize(
    ("reward", "name", "cause"),
    [
        (grader_offline, "grader_offline", ConnectionError),
        (CallableGrader(), "CallableGrader", ZeroDivisionError),
        (one_short, "one_short", ValueError),
    ],
)
def test_a_failing_reward_function_is_named_with_the_step(tmp_path, reward, name, cause):
    error, blame = blamed(trainer_with(tmp_path, [count_vowels_reward, reward]), cause)
    assert re.match(rf"reward function '{name}' raised \w+ at optimizer step 1", str(blame)), str(blame)
    assert blame.step == 1 and blame.source == f"reward function '{name}'"


def test_an_error_outside_the_reward_functions_is_left_as_it_is(tmp_path, monkeypatch):
    trainer = trainer_with(tmp_path, count_vowels_reward)

    def broken(*args, **kwargs):
        raise RuntimeError("not the user's doing")

    monkeypatch.setattr("stapo_trl.core.trl_seams.GRPOTrainer._calculate_rewards", broken)
    error, blame = blamed(trainer, RuntimeError)
    assert "not the user's doing" in str(error) and blame is None


def test_infinite_rewards_are_warned_about_with_the_function_that_returned_them(tmp_path, caplog):
    trainer = trainer_with(tmp_path, [count_vowels_reward, infinite_first])
    with caplog.at_level(logging.WARNING, logger="stapo_trl.rewards.blame"):
        trainer.train()
    warnings = [record.getMessage() for record in caplog.records if record.name == "stapo_trl.rewards.blame"]
    assert len(warnings) == 1
    assert (
        "Reward function 'infinite_first' returned 1 infinite reward(s) of 8 at optimizer step 1 (the first at completion 0: inf)"
        in warnings[0]
    )


def test_the_command_line_blames_the_users_reward_and_says_how_to_resume(tmp_path):
    """A reward that fails at step 2, after checkpoint-1: exit 1, the user's traceback, the function and the step, and
    the resume command; not the "bug in stapo-trl" line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from tiny import save_tiny_chat_model

    (tmp_path / "flaky_grader.py").write_text(
        "def graded(completions, trainer_state, **kwargs):\n"
        "    if trainer_state.global_step >= 1:\n"
        "        raise ConnectionError('grader at 10.0.0.7 unreachable')\n"
        "    return [1.0 if 'a' in str(c) else 0.0 for c in completions]\n"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(save_tiny_chat_model(tmp_path / "model")),
                "dataset_name": "sample",
                "reward_funcs": ["flaky_grader.graded"],
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 8,
                "max_steps": 3,
                "use_cpu": True,
                "bf16": False,
                "report_to": "none",
                "save_strategy": "steps",
                "save_steps": 1,
                "disable_tqdm": True,
                "output_dir": str(tmp_path / "run"),
            }
        )
    )
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "stapo_trl", "train", "--config", str(recipe)],
        cwd=repo,
        env={**environment, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "flaky_grader.py" in result.stderr and "ConnectionError: grader at 10.0.0.7 unreachable" in result.stderr
    assert "reward function 'graded' raised ConnectionError at optimizer step 2" in result.stderr
    assert "This came from your code, not from stapo-trl." in result.stderr
    assert "bug in stapo-trl" not in result.stderr
    assert result.stderr.rstrip().endswith("--resume_from_checkpoint last")
