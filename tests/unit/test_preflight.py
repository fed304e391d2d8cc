"""What `stapo-trl train` checks before loading a model: an earlier run in output_dir is refused or, when asked,
deleted (its checkpoints and run files only); a fresh or unrelated directory passes."""

from __future__ import annotations

import pytest

from stapo_trl.cli.recipe import RecipeError
from stapo_trl.cli.train import check_output_dir, earlier_run


def make_run(directory):
    (directory / "checkpoint-5").mkdir(parents=True)
    (directory / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (directory / "checkpoint-10").mkdir()  # incomplete: no trainer_state.json
    for name in ("run_summary.json", "metrics.jsonl", "adapter_model.safetensors"):
        (directory / name).write_text("x")
    (directory / "notes.txt").write_text("mine")
    (directory / "tiny-model").mkdir()
    (directory / "tiny-model" / "model.safetensors").write_text("weights of another model")


def test_a_new_or_unrelated_directory_passes(tmp_path):
    assert check_output_dir(str(tmp_path / "new"), None, overwrite=False) is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert earlier_run(tmp_path / "mine") == []
    assert check_output_dir(str(tmp_path / "mine"), None, overwrite=False) is None


def test_an_earlier_run_is_refused_with_the_ways_out(tmp_path):
    make_run(tmp_path)
    assert earlier_run(tmp_path) == [
        "checkpoint-5",
        "checkpoint-10",
        "run_summary.json",
        "metrics.jsonl",
        "adapter_model.safetensors",
    ]
    with pytest.raises(RecipeError) as info:
        check_output_dir(str(tmp_path), None, overwrite=False)
    message = str(info.value)
    assert "holds an earlier run (checkpoint-5, checkpoint-10, run_summary.json, metrics.jsonl and 1 more)" in message
    assert "Continue it with --resume_from_checkpoint last; replace it with --overwrite_output_dir true" in message
    assert (tmp_path / "run_summary.json").is_file()  # nothing touched


def test_resuming_continues_the_run_and_overwriting_deletes_only_its_files(tmp_path):
    make_run(tmp_path)
    assert check_output_dir(str(tmp_path), "last", overwrite=False) is None
    with pytest.raises(RecipeError, match="Set only one of them"):
        check_output_dir(str(tmp_path), "last", overwrite=True)

    note = check_output_dir(str(tmp_path), None, overwrite=True)
    assert note.startswith("overwrite_output_dir: deleted the earlier run's checkpoint-5, checkpoint-10")
    assert earlier_run(tmp_path) == []
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "tiny-model" / "model.safetensors").is_file()


def test_a_run_without_a_complete_checkpoint_is_not_offered_a_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RecipeError) as info:
        check_output_dir(str(tmp_path), None, overwrite=False)
    assert "resume_from_checkpoint" not in str(info.value)
    assert "Replace it with --overwrite_output_dir true; or choose another --output_dir." in str(info.value)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecipeError, match="is a file, not a directory"):
        check_output_dir(str(tmp_path / "file"), None, overwrite=False)
