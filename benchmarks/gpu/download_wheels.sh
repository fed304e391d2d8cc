#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu/wheels.txt for the GPU machine's Python 3.12 (x86-64 Linux) into .whl/ at the
# repository root (git-ignored), and print their total size: they travel with the working tree, 64 MiB in all.
#   bash benchmarks/gpu/download_wheels.sh            (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
mapfile -t packages < <(grep -v '^#' benchmarks/gpu/wheels.txt | grep -v '^[[:space:]]*$')
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${packages[@]}"
for package in "${packages[@]}"; do
    name="${package%%==*}"
    version="${package##*==}"
    ls .whl/"${name//-/_}"-"$version"-*.whl
done
du -cb .whl/*.whl | tail -1 | awk '{printf "wheels in .whl/: %.1f MiB\n", $1 / 1048576}'
