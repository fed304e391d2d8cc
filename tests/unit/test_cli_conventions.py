"""`stapo-trl` behaves at its edges as `trl grpo` does: no stray positional arguments, transformers' own flags left
to transformers, the `trl grpo` script flags taken or refused by name, `eval -h` grouped like `train -h`, and no
deprecation warning that the project can avoid."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import yaml

from stapo_trl.cli import main
from stapo_trl.cli.recipe import TRL_GRPO_REFUSED, parse_train_args

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml")
RECIPES = sorted(path for path in (REPO / "recipes").rglob("*.yaml") if "accelerate" not in path.parts)


@pytest.mark.parametrize(
    "argv",
    [
        ["stray", "--dry_run"],
        ["--max_steps", "3", "oops", "--dry_run"],
        ["--dry_run", "--num_processes", "2", "stray"],
    ],
    ids=["before-a-flag", "after-a-value", "after-a-launch-option"],
)
def test_a_stray_positional_argument_exits_2_with_one_line(argv, capsys):
    assert main(["train", "--config", QUICKSTART, *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("stapo-trl train: error: unexpected argument 'stray'") or "'oops'" in line
    assert "launch" not in captured.out


def test_launch_options_and_their_values_are_not_stray():
    request = parse_train_args(["--config", QUICKSTART, "--num_processes", "2", "--main_process_port=29555"])
    # The quickstart runs on the CPU, where two processes need accelerate's multi-process launcher named.
    assert request.launch_args == ["--num_processes", "2", "--main_process_port=29555", "--multi_gpu"]


def test_debug_is_transformers_training_argument_and_traceback_is_ours(capsys):
    request = parse_train_args(["--config", QUICKSTART, "--debug", "underflow_overflow", "--dry_run"])
    assert [str(getattr(option, "value", option)) for option in request.training.debug] == ["underflow_overflow"]
    assert request.launch_args == []
    missing = str(REPO / "no-such-recipe.yaml")
    assert main(["train", "--config", missing, "--traceback"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_trl_grpos_reward_model_flag_adds_a_reward_model_after_the_reward_functions(capsys):
    request = parse_train_args(["--config", QUICKSTART, "--reward_model_name_or_path", "my-org/rm", "--dry_run"])
    assert request.script.reward_model_name_or_path == "my-org/rm"
    assert main(["train", "--config", QUICKSTART, "--reward_model_name_or_path", "my-org/rm", "--dry_run"]) == 0
    assert re.search(r"rewards +dapo, reward model my-org/rm", capsys.readouterr().out)


@pytest.mark.parametrize("flag", sorted(TRL_GRPO_REFUSED))
def test_trl_grpo_flags_that_stapo_trl_does_not_take_are_refused_with_the_reason(flag, tmp_path, capsys):
    assert main(["train", "--config", QUICKSTART, f"--{flag}", "x", "--dry_run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--{flag}" in line and TRL_GRPO_REFUSED[flag] in line
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**yaml.safe_load(Path(QUICKSTART).read_text()), flag: "x"}))
    assert main(["train", "--config", str(recipe), "--dry_run"]) == 2
    assert TRL_GRPO_REFUSED[flag] in capsys.readouterr().err


def test_eval_help_groups_every_option_once_with_its_help(capsys):
    from stapo_trl.cli.help import EVAL_GROUPS
    from stapo_trl.evaluation import EvalConfig

    grouped = [name for _, names in EVAL_GROUPS for name in names]
    assert sorted(grouped) == sorted(item.name for item in dataclasses.fields(EvalConfig))
    assert main(["eval", "-h"]) == 0
    text = capsys.readouterr().out
    assert "--config FILE.yaml" in text and "--no_" not in text
    for name in grouped:
        assert len(re.findall(rf"^  --{name} ", text, flags=re.MULTILINE)) == 1, name
    assert main(["eval", "--help-all"]) == 0
    assert "--no_chat_template" in capsys.readouterr().out  # the raw parser's listing is still there


def test_the_dump_help_states_its_caps(capsys):
    from stapo_trl.diagnostics.token_dump import TokenDumpArguments

    fields = TokenDumpArguments.__dataclass_fields__
    help_text = fields["dump_silenced_tokens"].metadata["help"]
    assert "at most dump_tokens_per_step (64) a step" in help_text and "dump_max_tokens (5000) a run" in help_text
    assert fields["dump_tokens_per_step"].default == 64
    assert fields["dump_max_tokens"].default == 5000


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: str(path.relative_to(REPO / "recipes")))
def test_no_recipe_resolves_with_a_deprecation_warning(recipe):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_train_args(["--config", str(recipe), "--dry_run"])
    deprecated = [str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)]
    assert not deprecated, deprecated


def test_a_user_who_writes_the_deprecated_gradient_checkpointing_still_gets_what_they_wrote():
    from stapo_trl import STAPOConfig

    with pytest.warns(FutureWarning, match="gradient_checkpointing"):
        config = STAPOConfig(output_dir="out", use_cpu=True, gradient_checkpointing=False)
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        default = STAPOConfig(output_dir="out", use_cpu=True)
    assert default.activation_checkpointing is True  # TRL's default, without transformers' deprecation warning


def test_recipes_spell_activation_checkpointing_and_run_on_a_transformers_that_predates_it():
    from stapo_trl.cli.recipe import _spell_checkpointing_for_this_transformers, make_train_parser

    actions = {action.dest: action for action in make_train_parser()._actions}
    recipe, flags = {"activation_checkpointing": True}, ["--activation_checkpointing", "false", "--seed=1"]
    assert _spell_checkpointing_for_this_transformers(recipe, flags, actions) == (recipe, flags)  # 5.24 or newer
    older = {name: action for name, action in actions.items() if not name.startswith("activation_checkpointing")}
    assert _spell_checkpointing_for_this_transformers(
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {}},
        [*flags, "--activation_checkpointing=true"],
        older,
    ) == (
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {}},
        ["--gradient_checkpointing", "false", "--seed=1", "--gradient_checkpointing=true"],
    )


def test_the_readmes_gpu_commands_resolve_to_a_plan():
    """Not run on a GPU: each `stapo-trl train` line of the README's GPU section resolves (flags, recipe, launch)."""
    import shlex

    readme = (REPO / "README.md").read_text()
    block = re.search(r"## On GPUs\n.*?```bash\n(.*?)```", readme, flags=re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line.startswith("stapo-trl train ")]
    assert len(commands) >= 2
    for command in commands:
        request = parse_train_args([*shlex.split(command)[2:], "--dry_run"])
        assert request.world_size == 8 and request.training.use_vllm
    assert "--vllm_mode server" in block and "trl vllm-serve" in block and "--push_to_hub true" in block
