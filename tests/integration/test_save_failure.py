"""A save that fails (a full disk, a permission) loses nothing that was saved before: the previous complete checkpoint
stays the one a resume picks, and the final weights already in output_dir stay as they were."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.cli.train import FINAL_STAGING_DIR, save_final_model
from stapo_trl.core.resume import is_complete_checkpoint, resolve_resume_checkpoint


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_save_that_fails_leaves_the_previous_checkpoint_the_one_to_resume(tmp_path, monkeypatch):
    config = tiny_config(STAPOConfig, tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer = tiny_trainer(STAPOTrainer, config)
    original = STAPOTrainer._save_optimizer_and_scheduler

    def fail_at_step_2(self, output_dir):
        if self.state.global_step == 2:
            disk_full()
        return original(self, output_dir)

    monkeypatch.setattr(STAPOTrainer, "_save_optimizer_and_scheduler", fail_at_step_2)
    with pytest.raises(OSError, match="No space left on device"):
        trainer.train()

    assert is_complete_checkpoint(tmp_path / "checkpoint-1")  # save_total_limit=1 did not rotate it away
    assert not is_complete_checkpoint(tmp_path / "checkpoint-2")
    assert resolve_resume_checkpoint("last", tmp_path) == str(tmp_path / "checkpoint-1")


class Accelerator:
    is_main_process = True

    def wait_for_everyone(self):
        pass


class Trainer:
    """The part of a trainer `save_final_model` uses; `fail` makes the save write half a file, then hit a full disk."""

    accelerator = Accelerator()

    def __init__(self, weights: bytes, fail: bool = False):
        self.weights, self.fail = weights, fail

    def save_model(self, output_dir, _internal_call=False):
        assert _internal_call  # no Hub push from inside the save
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(self.weights[:2] if self.fail else self.weights)
        if self.fail:
            disk_full()
        (Path(output_dir) / "adapter_config.json").write_text('{"base_model_name_or_path": "/home/me/.cache/model"}')


def test_a_final_save_that_fails_leaves_the_weights_already_in_output_dir(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"earlier weights")
    with pytest.raises(OSError, match="No space left on device"):
        save_final_model(Trainer(b"new weights", fail=True), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == b"earlier weights"

    save_final_model(Trainer(b"new weights"), tmp_path, base_model="org/model")  # clears the staging it left
    assert (tmp_path / "model.safetensors").read_bytes() == b"new weights"
    assert not (tmp_path / FINAL_STAGING_DIR).exists()
    adapter = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/model"  # the name that resolves elsewhere, not the cache path


@pytest.mark.skipif(os.name == "nt", reason="Windows cannot open a directory to flush it")
def test_the_final_save_flushes_each_file_before_moving_it_and_output_dir_after(tmp_path, monkeypatch):
    """After a power loss, a file moved into place before its data reached the disk can be empty on some file
    systems: every staged file is flushed (``fsync``) before the first move, and ``output_dir`` after the last."""
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("move", os.stat(a).st_ino)) or replace(a, b))
    save_final_model(Trainer(b"new weights"), tmp_path, base_model="org/model")

    moved = [inode for kind, inode in events if kind == "move"]
    weights, adapter = ((tmp_path / name).stat().st_ino for name in ("model.safetensors", "adapter_config.json"))
    assert sorted(moved) == sorted([weights, adapter])
    first_move = events.index(("move", moved[0]))
    assert {("fsync", weights), ("fsync", adapter)} <= set(events[:first_move])
    assert events[-1] == ("fsync", tmp_path.stat().st_ino)
