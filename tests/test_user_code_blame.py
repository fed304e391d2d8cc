"""Blame where it belongs: the user's reward function raising, or returning the wrong number of rewards or infinite
ones, is reported as that function's doing, with the step."""

import logging
import math

import pytest
from tiny import build_char_tokenizer, build_tiny_qwen3, count_vowels_reward, prompt_dataset, tiny_config

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.errors import UserCodeError


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
    )


@pytest.mark.parametrize(
    ("reward", "name", "cause"),
    [
        (grader_offline, "grader_offline", ConnectionError),
        (CallableGrader(), "CallableGrader", ZeroDivisionError),
        (one_short, "one_short", ValueError),
    ],
)
def test_a_failing_reward_function_is_named_with_the_step(tmp_path, reward, name, cause):
    trainer = trainer_with(tmp_path, [count_vowels_reward, reward])
    with pytest.raises(UserCodeError, match=rf"reward function '{name}' raised \w+ at optimizer step 1") as caught:
        trainer.train()
    assert isinstance(caught.value.__cause__, cause)
    assert caught.value.step == 1 and caught.value.source == f"reward function '{name}'"


def test_an_error_outside_the_reward_functions_is_left_as_it_is(tmp_path, monkeypatch):
    trainer = trainer_with(tmp_path, count_vowels_reward)

    def broken(*args, **kwargs):
        raise RuntimeError("not the user's doing")

    monkeypatch.setattr("stapo_trl.trl_seams.GRPOTrainer._calculate_rewards", broken)
    with pytest.raises(RuntimeError, match="not the user's doing"):
        trainer.train()


def test_infinite_rewards_are_warned_about_with_the_function_that_returned_them(tmp_path, caplog):
    trainer = trainer_with(tmp_path, [count_vowels_reward, infinite_first])
    with caplog.at_level(logging.WARNING, logger="stapo_trl.user_code"):
        trainer.train()
    warnings = [record.getMessage() for record in caplog.records if record.name == "stapo_trl.user_code"]
    assert len(warnings) == 1
    assert (
        "Reward function 'infinite_first' returned 1 infinite reward(s) of 8 at optimizer step 1 (the first at completion 0: inf)"
        in warnings[0]
    )
