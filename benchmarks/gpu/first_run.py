"""Section ``first-run``: does GRPO's first training run in a process still differ from its second with cuDNN attention
off?

The first GPU check found GRPO's first run in a process differing from its later runs, which agreed bit for bit
(``equivalence``: Qwen3-0.6B shape, seeded random weights, 3 steps, deterministic algorithms on), in both processes
that ran it; the one op torch flagged as having no deterministic implementation was cuDNN's attention. Here each mode
runs in a fresh process (``python -m gpu.first_run``), so that its first run is the process's first: GRPO twice at the
``equivalence`` section's settings, then the two runs compared, parameters and every logged number.

Modes:

- ``math``: cuDNN, flash and memory-efficient attention switched off (``torch.backends.cuda.enable_*_sdp(False)``), so
  scaled-dot-product attention runs as plain matrix products and a softmax;
- ``default``: the attention backends as torch picks them, the first check's setting: the control, in the same session.

On the CPU (toy model, no CUDA attention backends) both runs must be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
MODES = ("math", "default")


def set_attention(mode: str) -> dict:
    """Switch the CUDA attention backends for ``mode``; returns which are enabled."""
    import torch

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "math":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    return {
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }


def grpo_twice(device: str, mode: str) -> dict:
    """In this process: GRPO's first and second runs from the same seeded weights and seed, compared."""
    import torch
    from datasets import Dataset

    from .equivalence import deterministic, log_difference, moved_share, nondeterministic_ops, parameter_difference
    from .models import ModelFactory, arithmetic_rows, build_tokenizer, vowel_share_reward
    from .plan import plan_for
    from .training import build_trainer, config_classes, free_memory, recipe_config, scratch_dir, train

    plan = plan_for(device)
    backends = set_attention(mode)
    tokenizer = build_tokenizer(plan.model.vocab_size)
    factory = ModelFactory(plan.model, tokenizer, device=device, dtype=torch.bfloat16)
    rows = arithmetic_rows(plan.run.num_prompts)
    dataset = Dataset.from_dict({"prompt": rows["prompt"], "solution": rows["solution"]})
    results = []
    with deterministic(device) as caught:
        for _ in range(2):
            config = recipe_config(
                config_classes("grpo"),
                plan,
                scratch_dir(),
                max_steps=plan.equivalence_steps,
                learning_rate=plan.equivalence_learning_rate,
            )
            model = factory.build()
            trainer = build_trainer("grpo", model, tokenizer, dataset, [vowel_share_reward], config)
            results.append(train(trainer, "grpo", _NoDeadline(), device, keep_parameters=True))
            del trainer, model
            free_memory()
    first, second = results
    parameters, differing = parameter_difference(first.parameters, second.parameters)
    logged, first_difference = log_difference(first.logs, second.logs)
    return {
        "mode": mode,
        "device": device,
        "model": plan.model.name,
        "steps": plan.equivalence_steps,
        "learning_rate": plan.equivalence_learning_rate,
        "attention_backends": backends,
        "nondeterministic_ops": nondeterministic_ops(caught),
        "moved_share": moved_share(first.parameters, factory.weights),
        "parameter_difference": parameters,
        "differing_tensors": len(differing),
        "logged_difference": logged,
        "first_logged_difference": first_difference,
        "step_1_loss": [run.logs[0].get("loss") if run.logs else None for run in results],
        "seconds": [round(run.wall_seconds, 2) for run in results],
    }


class _NoDeadline:
    """The clock `train` asks: this process is stopped from outside, by the section's timeout."""

    @staticmethod
    def left() -> float:
        return float("inf")


def run_mode(mode: str, device: str, out: Path, timeout: float) -> dict:
    """Run ``mode`` in a fresh process; its result, or the reason it has none."""
    result_path = out / f"first_run_{mode}.json"
    result_path.unlink(missing_ok=True)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(BENCHMARKS), str(REPO), os.environ.get("PYTHONPATH")])
    )
    if device == "cuda":
        environment.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    command = [sys.executable, "-m", "gpu.first_run", "--mode", mode, "--device", device, "--out", str(result_path)]
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the section's deadline after {timeout:.0f} s"}
    if finished.returncode != 0 or not result_path.is_file():
        return {"error": f"exit code {finished.returncode}: {finished.stderr.strip()[-1500:]}"}
    result = json.loads(result_path.read_text())
    result["process_seconds"] = round(time.perf_counter() - started, 1)
    return result


def run(section, plan, environment: dict) -> None:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-first-run-"))
    section.note(
        "settings", {"model": plan.model.name, "steps": plan.equivalence_steps, "modes": plan.first_run_modes}
    )
    for mode in plan.first_run_modes:
        if section.clock.left() < plan.first_run_estimate_s:
            section.skip(
                f"{mode}: GRPO first run against second",
                f"needs about {plan.first_run_estimate_s:.0f} s; {section.clock.left():.0f} s were left",
            )
            continue
        result = run_mode(mode, section.device, out, timeout=section.clock.left())
        if "error" in result:
            section.record(f"{mode}: GRPO twice in one process", "error", "", "runs", False, result["error"])
            continue
        record_mode(section, result)


def record_mode(section, result: dict) -> None:
    mode = result["mode"]
    section.note(f"{mode} run", result)
    for quantity, value, detail in (
        ("parameter", result["parameter_difference"], f"{result['differing_tensors']} tensors differ"),
        ("logged", result["logged_difference"], result["first_logged_difference"] or ""),
    ):
        name = f"{mode}: GRPO first run against second, largest {quantity} difference"
        verdict = "bit-identical" if value == 0 else f"the first run differs ({detail})"
        if section.on_cuda:
            section.record(name, value, "", "", None, verdict)
        else:
            section.record(name, value, "", "0 (bit-identical)", value == 0, verdict if value else "")
    if section.on_cuda:
        section.record(
            f"{mode}: ops without a deterministic implementation",
            len(result["nondeterministic_ops"]),
            "",
            "",
            None,
            "; ".join(result["nondeterministic_ops"]) or "none flagged",
        )
    section.record(
        f"{mode}: share of weights the first run's steps changed",
        result["moved_share"],
        "",
        "> 0, else identical weights prove nothing",
        result["moved_share"] > 0,
        f"attention backends enabled: {', '.join(name for name, on in result['attention_backends'].items() if on)}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args()
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    result = grpo_twice(args.device, args.mode)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
