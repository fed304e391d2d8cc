"""Files too large for one device call, sent in parts over consecutive calls and joined on the GPU machine.

What travels with one call of the device tool is at most 64 MiB: the working tree (tracked and untracked-not-ignored
files) and the carried paths. The machine stays warm 30 s after a call and keeps the ignored files already there
between calls, so a larger file can travel in parts:

- here, `split` lays the files end to end as one byte stream and cuts it into parts, one per call, each in its own
  ignored folder ``.gpu_send/call-K/`` with the part and ``manifest.json`` (every file's name, size, sha256 and place
  in the stream; every part's byte range and sha256);
- there, every call runs `receive`, which checks the part that travelled with it against the manifest and moves it
  into ``.gpu_received/<bundle>/`` (ignored and never carried, so it stays as long as the machine does);
- the call that runs the check then runs `join`: each file whose parts are all there is written out and checked
  against its sha256; a file with a part missing is named, with the calls that must be sent again.

A part is missing when the machine was given back between calls (after 30 s idle, or at its 30-minute limit): the new
machine starts bare. Nothing here can tell that apart from a call that was never sent; the message names both.

    python benchmarks/gpu/parts.py receive       # on the device, in every call
    python benchmarks/gpu/parts.py join          # on the device, in the last call (device_run.py does both)

Python's standard library only: the GPU machine's Python runs it before any wheel is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEND_DIR = REPO / ".gpu_send"
RECEIVED_DIR = REPO / ".gpu_received"
MANIFEST = "manifest.json"
PART = "part"
CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def call_folder(send_dir: Path, call: int) -> Path:
    return send_dir / f"call-{call}"


def part_ranges(total: int, calls: int) -> list[tuple[int, int]]:
    """(offset, size) of each of ``calls`` parts of a ``total``-byte stream, as equal as whole bytes allow."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    base, extra = divmod(total, calls)
    ranges, offset = [], 0
    for index in range(calls):
        size = base + (1 if index < extra else 0)
        ranges.append((offset, size))
        offset += size
    return ranges


def bundle_id(files: list[dict], calls: int) -> str:
    described = json.dumps([[f["name"], f["size"], f["sha256"]] for f in files] + [calls]).encode()
    return hashlib.sha256(described).hexdigest()[:12]


def split(sources: list[tuple[Path, str]], send_dir: Path, calls: int) -> dict:
    """Lay ``sources`` ((path, name in the bundle), in order) end to end and cut the stream into ``calls`` parts:
    ``send_dir/call-K/part`` and ``send_dir/call-K/manifest.json`` for K = 1..calls. Earlier ``call-*`` folders in
    ``send_dir`` are removed first. Returns the manifest."""
    files, offset = [], 0
    for path, name in sources:
        size = path.stat().st_size
        files.append({"name": name, "size": size, "sha256": sha256_of(path), "offset": offset})
        offset += size
    if len({f["name"] for f in files}) != len(files):
        raise ValueError("two files of the bundle have the same name")
    ranges = part_ranges(offset, calls)
    for old in send_dir.glob("call-*"):
        shutil.rmtree(old)
    parts = []
    stream = ConcatenatedFiles([path for path, _ in sources])
    for call, (start, size) in enumerate(ranges, 1):
        folder = call_folder(send_dir, call)
        folder.mkdir(parents=True)
        digest = hashlib.sha256()
        with open(folder / PART, "wb") as handle:
            left = size
            while left:
                block = stream.take(min(left, CHUNK))
                handle.write(block)
                digest.update(block)
                left -= len(block)
        parts.append({"call": call, "offset": start, "size": size, "sha256": digest.hexdigest()})
    manifest = {"bundle": bundle_id(files, calls), "total": offset, "files": files, "parts": parts}
    for call in range(1, calls + 1):
        (call_folder(send_dir, call) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class ConcatenatedFiles:
    """The bytes of several files end to end, taken in pieces."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self.handle = None

    def take(self, size: int) -> bytes:
        """Up to ``size`` bytes (fewer at the end of a file)."""
        while True:
            if self.handle is None:
                if not self.paths:
                    raise ValueError("the files ended before the parts did (a file changed while it was split)")
                self.handle = open(self.paths.pop(0), "rb")  # noqa: SIM115 (closed when it is used up)
            block = self.handle.read(size)
            if block:
                return block
            self.handle.close()
            self.handle = None


def receive(send_dir: Path = SEND_DIR, received_dir: Path = RECEIVED_DIR) -> tuple[list[str], list[str]]:
    """Check each part in ``send_dir/call-*`` against its manifest and move it into ``received_dir/<bundle>/``
    (a damaged part is deleted). Returns (report lines, the bundles of the parts that arrived)."""
    lines, bundles = [], []
    for folder in sorted(send_dir.glob("call-*")):
        manifest_path, part_path = folder / MANIFEST, folder / PART
        if not manifest_path.is_file() or not part_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        call = int(folder.name.split("-", 1)[1])
        expected = next(part for part in manifest["parts"] if part["call"] == call)
        size = part_path.stat().st_size
        digest = sha256_of(part_path)
        if size != expected["size"] or digest != expected["sha256"]:
            part_path.unlink()
            lines.append(
                f"part of call {call} arrived damaged ({size} bytes, sha256 {digest[:12]}; the manifest says "
                f"{expected['size']} bytes, {expected['sha256'][:12]}): deleted; send call {call} again"
            )
            continue
        target = received_dir / manifest["bundle"]
        target.mkdir(parents=True, exist_ok=True)
        (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.move(str(part_path), str(target / f"{PART}-{call}"))
        bundles.append(manifest["bundle"])
        lines.append(f"received call {call} of {len(manifest['parts'])} ({size / 2**20:.1f} MiB, sha256 verified)")
    if not bundles and not lines:
        lines.append(f"no part travelled with this call (nothing in {send_dir.name}/call-*/)")
    return lines, bundles


def present_calls(folder: Path, manifest: dict) -> list[int]:
    """The calls whose part is in ``folder`` at the manifest's size (checked against its sha256 when it arrived)."""
    return [
        part["call"]
        for part in manifest["parts"]
        if (folder / f"{PART}-{part['call']}").is_file()
        and (folder / f"{PART}-{part['call']}").stat().st_size == part["size"]
    ]


def calls_of(file: dict, parts: list[dict]) -> list[int]:
    """The calls whose parts hold some byte of ``file``."""
    start, end = file["offset"], file["offset"] + file["size"]
    return [part["call"] for part in parts if part["offset"] < end and start < part["offset"] + part["size"]]


def join(bundle: str | None, received_dir: Path = RECEIVED_DIR) -> dict:
    """Write out every file of ``bundle`` whose parts are all in ``received_dir/<bundle>/``, into ``files/`` beside
    them, and check it against its sha256. Returns the status: each file's path (None when it is not whole) and
    status, the calls received and missing, whether the bundle is complete, and a message that says what to do."""
    folder = received_dir / bundle if bundle else None
    if folder is None or not (folder / MANIFEST).is_file():
        return {
            "bundle": bundle,
            "complete": False,
            "files": {},
            "received_calls": [],
            "missing_calls": [],
            "message": "no part of any bundle is on this machine: no call that carried a part reached it, or the "
            "machine was given back since (it keeps files only while it stays warm, 30 s after a call)",
        }
    manifest = json.loads((folder / MANIFEST).read_text())
    present = present_calls(folder, manifest)
    missing = [part["call"] for part in manifest["parts"] if part["call"] not in present]
    files = {}
    for file in manifest["files"]:
        needed = calls_of(file, manifest["parts"])
        lacking = [call for call in needed if call in missing]
        entry = {"size": file["size"], "sha256": file["sha256"], "calls": needed, "path": None}
        if lacking:
            entry["status"] = f"parts missing: calls {_listed(lacking)}"
        else:
            path = folder / "files" / file["name"]
            if _write_file(folder, manifest["parts"], file, path):
                entry.update(path=str(path), status="verified")
            else:
                entry["status"] = "sha256 mismatch after joining"
        files[file["name"]] = entry
    complete = all(entry["status"] == "verified" for entry in files.values())
    calls = len(manifest["parts"])
    if complete:
        message = f"all {calls} parts here; every file joined and its sha256 verified"
    else:
        unusable = ", ".join(name for name, entry in files.items() if entry["path"] is None)
        message = (
            f"not whole here: {unusable}. Parts of call(s) {_listed(missing)} of {calls} are not on this machine: "
            "it was given back between calls (it keeps files only while it stays warm, 30 s after a call), or those "
            f"calls were not sent. Send call(s) {_listed(missing)} again, each as prepared, then this call"
            if missing
            else f"not whole here: {unusable} (every part arrived, but the joined file does not match its sha256)"
        )
    return {
        "bundle": manifest["bundle"],
        "complete": complete,
        "files": files,
        "received_calls": present,
        "missing_calls": missing,
        "message": message,
    }


def _listed(calls: list[int]) -> str:
    return ", ".join(str(call) for call in calls)


def _write_file(folder: Path, parts: list[dict], file: dict, path: Path) -> bool:
    """Write ``file`` from the parts that hold it (kept if already written and whole); whether its sha256 matches."""
    if path.is_file() and path.stat().st_size == file["size"] and sha256_of(path) == file["sha256"]:
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    start, end = file["offset"], file["offset"] + file["size"]
    with open(partial, "wb") as output:
        for part in parts:
            low, high = max(start, part["offset"]), min(end, part["offset"] + part["size"])
            if low >= high:
                continue
            with open(folder / f"{PART}-{part['call']}", "rb") as handle:
                handle.seek(low - part["offset"])
                left = high - low
                while left:
                    block = handle.read(min(left, CHUNK))
                    if not block:
                        raise OSError(f"part of call {part['call']} is shorter than its manifest says")
                    output.write(block)
                    digest.update(block)
                    left -= len(block)
    if digest.hexdigest() != file["sha256"]:
        partial.unlink()
        return False
    partial.replace(path)
    return True


def newest_bundle(received_dir: Path = RECEIVED_DIR) -> str | None:
    found = sorted(received_dir.glob(f"*/{MANIFEST}"), key=lambda path: path.stat().st_mtime)
    return found[-1].parent.name if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("receive", "join"))
    parser.add_argument("--send-dir", type=Path, default=SEND_DIR)
    parser.add_argument("--received-dir", type=Path, default=RECEIVED_DIR)
    parser.add_argument("--status", type=Path, default=None, help="join: write the status here as JSON")
    args = parser.parse_args()
    lines, bundles = receive(args.send_dir, args.received_dir)
    for line in lines:
        print(f"[parts] {line}", flush=True)
    bundle = bundles[-1] if bundles else newest_bundle(args.received_dir)
    if args.command == "receive":
        if bundle:
            manifest = json.loads((args.received_dir / bundle / MANIFEST).read_text())
            present = present_calls(args.received_dir / bundle, manifest)
            print(f"[parts] bundle {bundle}: calls here {_listed(present) or 'none'} of {len(manifest['parts'])}")
        return
    status = join(bundle, args.received_dir)
    print(f"[parts] bundle {status['bundle']}: {status['message']}", flush=True)
    if args.status is not None:
        args.status.write_text(json.dumps(status, indent=1) + "\n")
    sys.exit(0 if status["complete"] else 3)


if __name__ == "__main__":
    main()
