#!/usr/bin/env bash
# The one command of the GPU check on the lent GPU machine: install the carried wheels of wheels.txt (from .whl/,
# see download_wheels.sh) into /tmp/site, then run benchmarks/gpu_check.py under a hard time limit, with its output
# teed into OUT_DIR. Options after OUT_DIR go to gpu_check.py (--commit SHA: the device copy has no git).
#   bash benchmarks/gpu/run_on_device.sh "$OUT" --commit "$(git rev-parse HEAD)"
# GPU_CHECK_DEADLINE (default 390 s) is the check's own deadline; the process is sent SIGTERM 45 s after it, and the
# JSON then holds what was measured. PYTHON picks the interpreter (default python3, the one that holds torch there).
set -uo pipefail
out="${1:?usage: run_on_device.sh OUT_DIR [gpu_check.py options]}"
shift
cd "$(dirname "$0")/../.."
mkdir -p "$out"
python="${PYTHON:-python3}"
site="${GPU_CHECK_SITE:-/tmp/site}"
deadline="${GPU_CHECK_DEADLINE:-390}"

wheels=()
while read -r package; do
    name="${package%%==*}"
    version="${package##*==}"
    found=(.whl/"${name//-/_}"-"$version"-*.whl)
    if [ ! -f "${found[0]}" ]; then
        echo "missing wheel for $package in .whl/: run benchmarks/gpu/download_wheels.sh and carry .whl" >&2
        exit 2
    fi
    wheels+=("${found[0]}")
done < <(grep -v '^#' benchmarks/gpu/wheels.txt | grep -v '^[[:space:]]*$')
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    ${GPU_CHECK_PIP_OPTIONS:-} "${wheels[@]}" || exit 3
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$python" - <<'PY' 2>&1 | tee "$out/environment.txt"
import importlib.metadata as metadata
import platform
names = ("torch", "triton", "transformers", "trl", "accelerate", "peft", "datasets", "liger-kernel", "pyarrow",
         "fsspec", "huggingface_hub", "tokenizers", "nvidia-cutlass-dsl")
versions = []
for name in names:
    try:
        versions.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        versions.append(f"{name} -")
print(f"python {platform.python_version()}; " + ", ".join(versions))
PY
timeout --signal=TERM --kill-after=15 $((${deadline%.*} + 45)) \
    "$python" benchmarks/gpu_check.py --out "$out" --deadline "$deadline" "$@" 2>&1 | tee "$out/console.log"
status=${PIPESTATUS[0]}
echo "gpu_check exit status $status"
exit "$status"
