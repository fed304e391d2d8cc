"""The wheels the GPU machine lacks, fetched here for its Python 3.12 on x86-64 Linux, and each one's declared needs.

Two lists, beside this file: ``wheels.txt`` (small, pure Python: they travel whole in ``.whl/``, as the device
README describes) and ``cutlass_wheels.txt`` (Liger's Hopper kernel: ``nvidia-cutlass-dsl`` and its libraries, about
92 MB, which travel in parts, `gpu.parts`). The cutlass wheels are recompressed with LZMA before they are split
(`recompress_lzma`): the same files, byte for byte, in a zip whose members are LZMA instead of deflate, which
``pip install`` reads as it reads any wheel (Python's ``zipfile`` decompresses both); the 92 MB CUDA 13 library wheel
shrinks by about a third, which saves one device call.

    python benchmarks/gpu/wheelhouse.py download benchmarks/gpu/wheels.txt .whl       # what download_wheels.sh runs
    python benchmarks/gpu/wheelhouse.py requirements .whl .gpu_stage/cutlass          # each wheel's Requires-Dist
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEELS = HERE / "wheels.txt"
CUTLASS_WHEELS = HERE / "cutlass_wheels.txt"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
"""The GPU machine's Python 3.12 on x86-64 Linux: the platform tags pip may pick a wheel for (pip matches each exactly;
``apache-tvm-ffi`` ships only ``manylinux_2_24``/``2_28``)."""


def pinned_packages(requirements: Path) -> list[str]:
    """The ``name==version`` lines of a list, without comments and blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in requirements.read_text().splitlines())
    packages = [line for line in lines if line]
    for package in packages:
        if "==" not in package:
            raise ValueError(f"{requirements}: {package!r} is not pinned (name==version); the device installs no-deps")
    return packages


def wheel_file_prefix(package: str) -> str:
    """The start of a wheel's file name for ``name==version``: the name normalised as wheels spell it."""
    name, version = package.split("==")
    return f"{name.replace('-', '_').replace('.', '_')}-{version}-"


def find_wheel(folder: Path, package: str) -> Path | None:
    found = sorted(folder.glob(wheel_file_prefix(package) + "*.whl"))
    return found[0] if found else None


def download(requirements: Path, folder: Path, python: str = sys.executable) -> list[Path]:
    """Download each pinned package of ``requirements`` for Python 3.12 on x86-64 Linux into ``folder`` (no
    dependencies: the lists name each one), skipping those already there; the wheels, in the list's order."""
    packages = pinned_packages(requirements)
    missing = [package for package in packages if find_wheel(folder, package) is None]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
        subprocess.run(
            [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
             "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *missing],
            check=True,
        )  # fmt: skip
    wheels = [find_wheel(folder, package) for package in packages]
    absent = [package for package, wheel in zip(packages, wheels, strict=True) if wheel is None]
    if absent:
        raise FileNotFoundError(f"pip downloaded no wheel for {', '.join(absent)} into {folder}")
    return wheels


def requirements_of(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA, without those of extras."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode("utf-8", errors="replace")
    lines = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [line for line in lines if "extra ==" not in line]


def recompress_lzma(wheel: Path, target_folder: Path) -> Path:
    """``wheel`` rewritten into ``target_folder`` under the same name with every member LZMA-compressed: the same
    member names, bytes, timestamps and permission bits (so RECORD still holds). Kept if already written from a wheel
    of the same size and time."""
    target = target_folder / wheel.name
    stamp = target_folder / f"{wheel.name}.source"
    source_id = f"{wheel.stat().st_size} {wheel.stat().st_mtime_ns}"
    if target.is_file() and stamp.is_file() and stamp.read_text() == source_id:
        return target
    target_folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_LZMA) as output:
        for member in source.infolist():
            copy = zipfile.ZipInfo(member.filename, member.date_time)
            copy.external_attr = member.external_attr
            copy.compress_type = zipfile.ZIP_LZMA
            output.writestr(copy, source.read(member))
    partial.replace(target)
    stamp.write_text(source_id)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("download", help="download a list's wheels into a folder and print their sizes")
    fetch.add_argument("requirements", type=Path)
    fetch.add_argument("folder", type=Path)
    listing = commands.add_parser("requirements", help="print each wheel's Requires-Dist (extras left out)")
    listing.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args()
    if args.command == "download":
        wheels = download(args.requirements, args.folder)
        for wheel in wheels:
            print(f"{wheel} ({wheel.stat().st_size / 2**20:.2f} MiB)")
        print(f"wheels in {args.folder}: {sum(wheel.stat().st_size for wheel in wheels) / 2**20:.1f} MiB")
        return
    for folder in args.folders:
        for wheel in sorted(folder.glob("*.whl")):
            print(f"{wheel.name} ({wheel.stat().st_size / 2**20:.2f} MiB): {', '.join(requirements_of(wheel)) or '-'}")


if __name__ == "__main__":
    main()
