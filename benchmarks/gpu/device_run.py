"""Round two's command on the lent GPU machine (issue 49): take the part that travelled with this call, join the files
whose parts are all here, install the wheels, then run the check. The plan of calls is in ``benchmarks/gpu/README.md``.

    python3 benchmarks/gpu/device_run.py "$OUT" --commit SHA

1. `parts` receive and join: the part in ``.gpu_send/call-K/`` moves to ``.gpu_received/<bundle>/``, every file whose
   parts are all there is joined and checked against its sha256, and the status goes to ``OUT/parts.json``.
2. The wheels, installed with ``pip install --no-index --no-deps --target /tmp/site``: those of ``wheels.txt`` from
   ``.whl/`` (carried whole, in this call), and the bundle's wheels (Liger's Hopper kernel) when every one of them was
   joined. An install with ``--target`` runs no ``.pth`` file, so the folder that ``nvidia-cutlass-dsl``'s ``.pth``
   adds to ``sys.path`` goes on ``PYTHONPATH`` instead. On the CPU nothing is installed: the CPU mode runs with this
   environment's packages.
3. ``OUT/environment.txt``: Python's and the packages' versions.
4. ``gpu_check.py --sections quickstart kernels first-run --payload OUT/parts.json``, under ``timeout`` (SIGTERM 45 s
   after the check's deadline, SIGKILL 15 s later), its output teed into ``OUT/console.log``.

A file whose parts are not all here (the machine was given back between calls) does not stop the check: the section
that needs it is recorded as skipped with the join's message, which names the calls to send again; the others run.
Exit status: the check's; 2 when a wheel of ``wheels.txt`` is missing from ``.whl/``; 3 when pip fails.

Python's standard library only, up to the check itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import parts  # noqa: E402 (this folder, put on the path above: the device runs this file as a script)
import wheelhouse  # noqa: E402

REPO = HERE.parents[1]
ROUND_TWO = ["quickstart", "kernels", "first-run"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""Nothing outside the GPU machine can be reached: no library should wait on the Hugging Face Hub."""
VERSIONS = """
import importlib.metadata as metadata, platform
names = ("torch", "triton", "transformers", "trl", "accelerate", "peft", "datasets", "liger-kernel", "gguf",
         "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi", "tokenizers", "huggingface_hub")
found = []
for name in names:
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} -")
print(f"python {platform.python_version()}; " + ", ".join(found))
"""


class Console:
    """Lines printed here and appended to ``OUT/console.log``."""

    def __init__(self, out: Path):
        self.handle = open(out / "console.log", "a", buffering=1)  # noqa: SIM115 (open for the whole command)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.handle.write(line + "\n")


def bundle_wheels(status: dict) -> tuple[list[Path], str]:
    """(the bundle's wheels to install, what became of them): all of them when every one was joined, else none."""
    wheels = {name: entry for name, entry in status.get("files", {}).items() if name.endswith(".whl")}
    if not wheels:
        return [], "no wheel travelled in parts"
    broken = [name for name, entry in wheels.items() if entry["path"] is None]
    if broken:
        return [], f"not installed, {len(broken)} of {len(wheels)} not whole here: {', '.join(sorted(broken))}"
    return [Path(entry["path"]) for entry in wheels.values()], f"{len(wheels)} joined and installed"


def carried_wheels(wheel_dir: Path) -> tuple[list[Path], list[str]]:
    """(the wheels of wheels.txt found in ``wheel_dir``, the packages missing)."""
    found, missing = [], []
    for package in wheelhouse.pinned_packages(wheelhouse.WHEELS):
        wheel = wheelhouse.find_wheel(wheel_dir, package)
        (found.append(wheel) if wheel is not None else missing.append(package))
    return found, missing


def install(python: str, site: Path, wheels: list[Path]) -> int:
    command = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    command += ["--upgrade", "--target", str(site), *map(str, wheels)]
    return subprocess.run(command).returncode


def python_path(site: Path | None) -> str:
    entries = []
    if site is not None:
        entries.append(str(site))
        cutlass_packages = site / "nvidia_cutlass_dsl" / "dsl_packages"
        if cutlass_packages.is_dir():
            entries.append(str(cutlass_packages))
    entries.append(str(REPO))
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--commit", default=None, help="the commit of the checkout (the device copy has no git)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--deadline", type=float, default=390.0, help="the check's deadline, seconds")
    parser.add_argument("--sections", nargs="+", default=ROUND_TWO)
    parser.add_argument("--send-dir", type=Path, default=parts.SEND_DIR)
    parser.add_argument("--received-dir", type=Path, default=parts.RECEIVED_DIR)
    parser.add_argument("--wheel-dir", type=Path, default=REPO / ".whl")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console(args.out)

    lines, bundles = parts.receive(args.send_dir, args.received_dir)
    for line in lines:
        console.say(f"[parts] {line}")
    bundle = bundles[-1] if bundles else parts.newest_bundle(args.received_dir)
    status = parts.join(bundle, args.received_dir) if bundle else None
    if status is not None:
        console.say(f"[parts] bundle {status['bundle']}: {status['message']}")
        for name, entry in status["files"].items():
            console.say(f"[parts]   {name}: {entry['status']}")

    site = None
    if args.device == "cuda":
        wheels, missing = carried_wheels(args.wheel_dir)
        if missing:
            console.say(f"missing wheels in {args.wheel_dir}: {', '.join(missing)}; carry .whl (wheelhouse.py)")
            sys.exit(2)
        extra, note = bundle_wheels(status or {})
        console.say(f"[wheels] {len(wheels)} from {args.wheel_dir.name}; bundle wheels: {note}")
        if install(args.python, args.site, wheels + extra) != 0:
            console.say("pip install failed")
            sys.exit(3)
        site = args.site
    else:
        note = "not installed: the CPU mode runs with this environment's packages"
        console.say(f"[wheels] {note}")
    if status is not None:
        status["bundle_wheels"] = note
        (args.out / "parts.json").write_text(json.dumps(status, indent=1) + "\n")

    environment = {**OFFLINE, **os.environ, "PYTHONPATH": python_path(site), "PYTHONUNBUFFERED": "1"}
    versions = subprocess.run([args.python, "-c", VERSIONS], env=environment, capture_output=True, text=True)
    (args.out / "environment.txt").write_text(versions.stdout + versions.stderr)
    console.say(versions.stdout.strip() or versions.stderr.strip())

    check = [args.python, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(args.out), "--device", args.device]
    check += ["--deadline", str(args.deadline), "--sections", *args.sections]
    if status is not None:
        check += ["--payload", str(args.out / "parts.json")]
    if args.commit:
        check += ["--commit", args.commit]
    limit = int(args.deadline) + 45
    command = ["timeout", "--signal=TERM", "--kill-after=15", str(limit), *check]
    console.say("+ " + " ".join(command))
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        console.say(line.rstrip("\n"))
    code = process.wait()
    console.say(f"gpu_check exit status {code}")
    sys.exit(code)


if __name__ == "__main__":
    main()
