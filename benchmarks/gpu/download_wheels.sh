#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu/wheels.txt for the GPU machine's Python 3.12 (x86-64 Linux) into .whl/ at the
# repository root (git-ignored), and print their total size: they travel with the working tree, 64 MiB in all.
#   bash benchmarks/gpu/download_wheels.sh            (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python3}" benchmarks/gpu/wheelhouse.py download benchmarks/gpu/wheels.txt .whl
