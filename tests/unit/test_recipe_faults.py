"""Recipes and environments that used to be taken silently: a key given twice in a recipe (the same reader checks an
`eval` config file: test_bad_input.py's "eval: a key given twice"), and leftover torchrun variables that made a
one-process run wait for other processes forever."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_trl.cli import main
from stapo_trl.cli.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("method: stapo\nlearning_rate: 1.0e-6\nseed: 0\nlearning_rate: 2.0e-6\n")
    with pytest.raises(RecipeError, match=r"the key 'learning_rate' appears twice \(lines 2 and 4\)"):
        load_recipe(recipe)
    assert main(["train", "--config", str(recipe), "--dry_run"]) == 2


def test_nested_keys_may_repeat_across_mappings(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_init_kwargs:\n  revision: main\ngeneration_kwargs:\n  revision: x\n")
    assert load_recipe(recipe)["generation_kwargs"] == {"revision": "x"}


def test_leftover_distributed_variables_are_named_within_seconds(tmp_path):
    """WORLD_SIZE=2 left in the shell: the process waits for a second one that never comes, and says so."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tmp_path / 'absent-model'}\nuse_cpu: true\nbf16: false\n")
    environment = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29577",
        "STAPO_TRL_RENDEZVOUS_NOTE_SECONDS": "2",
    }
    with pytest.raises(subprocess.TimeoutExpired) as waited:  # it waits, as it must; it is stopped after 45 s
        subprocess.run(
            [
                sys.executable,
                "-m",
                "stapo_trl",
                "train",
                "--config",
                str(recipe),
                "--output_dir",
                str(tmp_path / "run"),
            ],
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=45,
        )
    stderr = waited.value.stderr or ""
    stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    assert "still waiting for the other processes of a 2-process run (WORLD_SIZE=2, RANK=0" in stderr, stderr[-2000:]
    assert "unset WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT" in stderr
