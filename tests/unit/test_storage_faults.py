"""Files stapo-trl writes: atomic whole-file writes, OS errors that name their file, storage failures explained,
damaged files named with what to do."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import save_tiny_chat_model

from stapo_trl.storage import (
    DamagedFileError,
    append_text,
    naming,
    read_json_file,
    storage_problem,
    sync_directory,
    write_text_atomically,
)

REPO = Path(__file__).resolve().parents[2]


def test_an_os_error_without_a_file_name_gets_one():
    with pytest.raises(OSError) as caught, naming("/data/run/metrics.jsonl"):
        raise OSError(errno.EFBIG, "File too large")
    assert caught.value.filename == "/data/run/metrics.jsonl" and caught.value.errno == errno.EFBIG
    assert storage_problem(caught.value) == (
        "could not write /data/run/metrics.jsonl: File too large (the file is larger than the filesystem or a limit "
        "(ulimit -f) allows)"
    )
    assert storage_problem(OSError(errno.ENOSPC, "No space left on device", "x")).endswith("(the disk is full)")
    assert storage_problem(ValueError("not storage")) is None
    rust = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    assert storage_problem(rust, "/data/run").startswith("could not write a file in /data/run: File too large")


def test_a_whole_file_is_replaced_atomically_and_no_partial_file_is_left(tmp_path):
    path = write_text_atomically(tmp_path / "summary.json", '{"a": 1}\n')
    write_text_atomically(path, '{"a": 2}\n')
    assert json.loads(path.read_text()) == {"a": 2}
    assert sorted(child.name for child in tmp_path.iterdir()) == ["summary.json"]


def record_syncs_and_renames(monkeypatch) -> list[tuple]:
    """``os.fsync`` and ``os.replace`` still run, and each call is recorded: ``("fsync", inode)`` of the file or
    directory flushed, ``("replace", inode of the file moved, destination)``."""
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(descriptor):
        events.append(("fsync", os.fstat(descriptor).st_ino))
        fsync(descriptor)

    def recorded_replace(source, destination):
        events.append(("replace", os.stat(source).st_ino, str(destination)))
        replace(source, destination)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


@pytest.mark.skipif(os.name == "nt", reason="Windows cannot open a directory to flush it")
def test_an_atomic_write_flushes_the_file_before_the_rename_and_its_directory_after(tmp_path, monkeypatch):
    events = record_syncs_and_renames(monkeypatch)
    path = write_text_atomically(tmp_path / "run_summary.json", '{"steps": 3}\n')
    written, directory = path.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", written), ("replace", written, str(path)), ("fsync", directory)]
    assert path.read_text() == '{"steps": 3}\n'


def test_an_append_is_flushed_to_the_storage(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    events = record_syncs_and_renames(monkeypatch)
    append_text(path, '{"step": 2}\n')
    assert events == [("fsync", path.stat().st_ino)]


def test_a_directory_that_cannot_be_flushed_is_passed_over_but_a_failing_disk_is_not(tmp_path, monkeypatch):
    def refuse(error_number):
        def fsync(descriptor):
            raise OSError(error_number, os.strerror(error_number))

        return fsync

    monkeypatch.setattr(os, "fsync", refuse(errno.EINVAL))  # a file system that does not sync directories
    sync_directory(tmp_path)
    monkeypatch.setattr(os, "fsync", refuse(errno.EIO))
    with pytest.raises(OSError) as raised:
        sync_directory(tmp_path)
    assert raised.value.errno == errno.EIO and raised.value.filename == str(tmp_path)


def test_the_stare_state_a_resume_reads_is_written_durably(tmp_path, monkeypatch):
    """The STARE controller's checkpoint state, which a resume reads, is flushed to the storage before its rename."""
    from stapo_trl.core.token_rules.stare_controller import STARE_STATE_FILE, STAREController

    events = record_syncs_and_renames(monkeypatch)
    STAREController(gate_mode="on").save_to(tmp_path)
    state = tmp_path / STARE_STATE_FILE
    assert ("replace", state.stat().st_ino, str(state)) in events and events[0] == ("fsync", state.stat().st_ino)


def test_a_damaged_file_is_named_with_the_remedy(tmp_path):
    path = tmp_path / "silenced_tokens_stats.json"
    path.write_text('{"silenced": 3, "wri')
    with pytest.raises(
        DamagedFileError, match=r"silenced_tokens_stats.json \(the dump's counts\) is damaged.*Delete it"
    ):
        read_json_file(path, "the dump's counts", "Delete it.")


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))


def test_a_file_size_limit_hit_while_training_names_the_file_and_the_cause(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(save_tiny_chat_model(tmp_path / "model")),
                "dataset_name": "sample",
                "reward_funcs": ["boxed"],
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 8,
                "max_steps": 2,
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
    result = subprocess.run(
        [sys.executable, "-m", "stapo_trl", "train", "--config", str(recipe)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()
    message = next(line for line in last if line.startswith("stapo-trl train: could not write "))
    assert (
        str(tmp_path / "run") in message and "File too large (the file is larger than the filesystem or a" in message
    )
    assert "bug in stapo-trl" not in result.stderr


def test_the_report_names_a_cut_off_dump_file(tmp_path):
    from test_report import write_dump, write_state

    from stapo_trl.diagnostics.report import load_run

    run = write_state(tmp_path / "stapo")
    write_dump(run)
    stats = run / "silenced_tokens_stats.json"
    stats.write_text(stats.read_text()[:50])
    with pytest.raises(DamagedFileError, match=r"silenced_tokens_stats.json \(the silenced-token dump's counts"):
        load_run(run)


def test_eval_names_a_cut_off_settings_file_and_a_samples_file_of_another_shape(tmp_path):
    from stapo_trl.evaluation.records import SampleStore

    store = SampleStore(tmp_path / "samples.jsonl", {"model": "m"})
    store.settings_path.write_text('{"model": ')
    with pytest.raises(DamagedFileError, match=r"samples.settings.json \(the settings of the samples beside it\)"):
        SampleStore(tmp_path / "samples.jsonl", {"model": "m"})

    other = tmp_path / "other"
    other.mkdir()
    (other / "samples.jsonl").write_text('{"question": "q", "answer": 1}\n')
    (other / "samples.settings.json").write_text('{"model": "m"}\n')
    with pytest.raises(DamagedFileError, match=r"record 1, lacks benchmark, problem_id, sample"):
        SampleStore(other / "samples.jsonl", {"model": "m"})
