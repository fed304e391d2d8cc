"""The first section: what this machine is, which path each kernel takes on it, and which statistics backend the
training sections can use.

Liger 0.8.5 dispatches its fused linear cross-entropy on compute capability 9.0 (H100, H200) to a CuTe DSL kernel
that needs ``nvidia-cutlass-dsl`` (the ``liger-kernel[cutedsl]`` extra), with no fallback: without it the call raises
ImportError. stapo-trl's ``auto`` statistics backend picks ``liger`` on such a GPU only when ``cutlass`` is importable
too (``torch`` otherwise); this section calls the backend ``auto`` resolves to and records whether it runs.
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "liger-kernel",
    "nvidia-cutlass-dsl",
    "tokenizers",
)


def package_versions() -> dict[str, str | None]:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def nvidia_smi(query: str) -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None


def device_facts(device: str) -> dict:
    import torch

    facts = {
        "python": platform.python_version(),
        "torch_cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=properties.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
            driver=nvidia_smi("driver_version"),
            cudnn=torch.backends.cudnn.version(),
        )
    return facts


def liger_path(device: str) -> tuple[str, str | None]:
    """(the implementation Liger's scaled cross-entropy takes on ``device``, why it cannot run or None)."""
    import importlib

    import torch

    try:
        importlib.import_module("liger_kernel.ops")
    except ImportError as error:
        return "not installed", f"liger-kernel does not import: {error}"
    if device == "cuda" and torch.cuda.get_device_capability(0) == (9, 0):
        try:
            importlib.import_module("liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90")
        except ImportError as error:
            return "CuTe DSL (sm90)", f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return "CuTe DSL (sm90)", None
    return "torch fallback (512-token chunks)", None


def trl_path(device: str) -> str:
    import torch
    from trl.kernels import chunked_logprob

    uses_triton = chunked_logprob._use_triton(torch.device(device))
    return "Triton fold over cuBLAS bf16 tiles" if uses_triton else "torch tiles (no Triton on this device)"


def auto_backend_runs(device: str) -> tuple[str, str | None]:
    """(the backend ``auto`` resolves to, the error it raises on a 4-token call or None)."""
    import torch

    from stapo_trl.core.token_stats.backends import resolve_backend, token_logprob_entropy

    backend = resolve_backend("auto", device)
    hidden = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    weight = torch.randn(128, 64, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, 128, (4,), device=device)
    try:
        with torch.no_grad():
            token_logprob_entropy(hidden, weight, targets, backend=backend)
    except Exception as error:
        return backend, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return backend, None


def run(section, plan, environment: dict) -> None:
    import torch

    if section.on_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    facts = device_facts(section.device)
    versions = package_versions()
    section.note("device", facts)
    section.note("packages", versions)
    section.report.data["provenance"].update(
        gpu=facts.get("gpu"),
        driver=facts.get("driver"),
        cuda=facts.get("torch_cuda"),
        capability=facts.get("capability"),
        gpu_packages=versions,
    )
    section.report.write()

    liger, liger_problem = liger_path(section.device)
    environment.update(liger_path=liger, liger_problem=liger_problem, trl_path=trl_path(section.device))
    section.record("TRL fused head path", environment["trl_path"], "", "", None)
    section.record("Liger scaled cross-entropy path", liger, "", "", None, liger_problem or "loads")

    backend, problem = auto_backend_runs(section.device)
    section.record(
        "token_stats_backend 'auto' runs",
        backend,
        "",
        "the backend 'auto' picks runs on this device",
        problem is None,
        problem or "",
    )
    environment["trainer_backend"] = "auto" if problem is None else "torch"
    section.record(
        "token_stats_backend of the training sections",
        environment["trainer_backend"],
        "",
        "",
        None,
        "" if problem is None else f"'auto' picks {backend!r}, which fails here; the training sections use 'torch'",
    )
