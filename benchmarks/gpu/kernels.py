"""Section 1: the statistics kernels against fp64, with their time and peak memory.

The inputs imitate a trained LM head: each token has a preferred vocabulary entry whose logit is lifted by up to 25
over a background of spread 2.5, so the entropies run from near 0 to near log V, and 80% of the targets are the
preferred token (high p) while 20% are drawn uniformly (low p, the S2T regime). Hidden states and the weight are bf16,
as in training; the fp64 reference is computed from those same bf16 values, in row chunks.

Tolerances. A kernel that rounds each logit z to bf16 (relative error at most 2**-8), as TRL's tiles do, and computes
the rest exactly is off, to first order, by at most ``2**-8 (|z_y| + E_p|z|)`` in log p and ``2**-8 E_p(|log p + H|
|z|)`` in H (the derivative of H with respect to z_v is ``-p_v (log p_v + H)``). The tolerance of each token is twice
its bound, plus the bf16 rounding of H itself where a kernel returns H in bf16 (``2**-8 H``), plus 1e-3 nats for
fp32 arithmetic: as accurate as bf16 logits allow. For the gradients (of ``sum(g * log p)``, as the loss
differentiates log p) the tolerance of the relative Frobenius error is twice that of the fp64 gradient computed
through bf16-rounded logits, plus 2**-7 for bf16 outputs.

Peak memory on CUDA is ``torch.cuda.max_memory_allocated`` above what was allocated before the call (inputs not
counted, outputs and gradients counted). The target is less than one bf16 ``[N, V]`` tensor: a kernel that
materialised the logits, in bf16 or wider, could not stay under it. On the CPU peak memory is not measured.
"""

from __future__ import annotations

import statistics
import time

import torch

ARITHMETIC_SLACK = 1e-3
BF16_UNIT_ROUNDOFF = 2.0**-8


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, seed: int = 0) -> dict:
    generator = torch.Generator(device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    def uniform(*shape):
        return torch.rand(*shape, generator=generator, device=device)

    weight = normal(vocab, hidden) * 0.02
    preferred = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    lift = 25.0 * uniform(tokens)
    rows = weight[preferred]
    background = 2.5 / (0.02 * hidden**0.5)
    hidden_states = background * normal(tokens, hidden) + lift[:, None] * rows / rows.square().sum(-1, keepdim=True)
    uniform_targets = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    targets = torch.where(uniform(tokens) < 0.8, preferred, uniform_targets)
    return {
        "hidden": hidden_states.to(torch.bfloat16),
        "weight": weight.to(torch.bfloat16),
        "targets": targets,
        "upstream": normal(tokens),
    }


def _exact_statistics(logits: torch.Tensor, targets: torch.Tensor):
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropies


@torch.no_grad()
def _rounding_sensitivity(logits: torch.Tensor, targets: torch.Tensor, entropies: torch.Tensor):
    """``(|z_y| + E_p|z|, E_p(|log p + H| |z|))``: times 2**-8, the first-order errors of log p and H when every
    logit is rounded to bf16."""
    log_softmax = torch.log_softmax(logits, dim=-1)
    probs = log_softmax.exp()
    magnitude = logits.abs()
    log_prob = magnitude.gather(-1, targets[:, None]).squeeze(-1) + (probs * magnitude).sum(-1)
    entropy = (probs * (log_softmax + entropies[:, None]).abs() * magnitude).sum(-1)
    return log_prob, entropy


def fp64_reference(inputs: dict, rows: int) -> dict:
    """Exact log p and H, their sensitivity to bf16 rounding of the logits, and the gradients of ``sum(g * log p)``: exact, and through
    logits rounded to bf16 (the baseline of the gradient tolerance)."""
    hidden, targets, upstream = inputs["hidden"], inputs["targets"], inputs["upstream"]
    exact_weight = inputs["weight"].double().requires_grad_()
    rounded_weight = inputs["weight"].double().requires_grad_()
    log_probs, entropies, log_prob_sensitivity, entropy_sensitivity = [], [], [], []
    grad_hidden, grad_hidden_rounded = [], []
    for start in range(0, hidden.shape[0], rows):
        end = min(start + rows, hidden.shape[0])
        chunk = hidden[start:end].double().requires_grad_()
        logits = chunk @ exact_weight.t()
        chunk_log_probs, chunk_entropies = _exact_statistics(logits, targets[start:end])
        (upstream[start:end].double() * chunk_log_probs).sum().backward()
        log_probs.append(chunk_log_probs.detach())
        entropies.append(chunk_entropies.detach())
        sensitivity = _rounding_sensitivity(logits.detach(), targets[start:end], chunk_entropies.detach())
        log_prob_sensitivity.append(sensitivity[0])
        entropy_sensitivity.append(sensitivity[1])
        grad_hidden.append(chunk.grad)
        del logits

        chunk = hidden[start:end].double().requires_grad_()
        logits = chunk @ rounded_weight.t()
        rounded = logits + (logits.detach().to(torch.bfloat16).double() - logits.detach())
        rounded_log_probs, _ = _exact_statistics(rounded, targets[start:end])
        (upstream[start:end].double() * rounded_log_probs).sum().backward()
        grad_hidden_rounded.append(chunk.grad)
        del logits, rounded
    return {
        "log_probs": torch.cat(log_probs),
        "entropies": torch.cat(entropies),
        "log_prob_sensitivity": torch.cat(log_prob_sensitivity),
        "entropy_sensitivity": torch.cat(entropy_sensitivity),
        "grad_hidden": torch.cat(grad_hidden),
        "grad_weight": exact_weight.grad,
        "grad_hidden_rounded": torch.cat(grad_hidden_rounded),
        "grad_weight_rounded": rounded_weight.grad,
    }


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((value.double() - reference).norm() / reference.norm().clamp_min(1e-300))


def kernel_functions(environment: dict) -> dict:
    """name -> (function(hidden, weight, targets) -> (log_probs, entropies), the path it takes, how training uses it)."""
    from stapo_trl.core.token_stats.backends import BACKENDS

    def liger_fallback(hidden, weight, targets, temperature=1.0):
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import _FusedLinearPPOFallbackFunction

        nll, entropies = _FusedLinearPPOFallbackFunction.apply(hidden, weight, targets.long(), temperature, -100, True)
        return -nll.float(), entropies.float()

    return {
        "trl_fused": (
            BACKENDS["trl_fused_head"],
            f"TRL ChunkedLogProbFunction: {environment['trl_path']}",
            "forward and backward (the loss)",
        ),
        "liger": (
            BACKENDS["liger"],
            f"LigerFusedLinearScaledCrossEntropyFunction: {environment['liger_path']}",
            "forward, no grad (statistics pass, backend 'liger')",
        ),
        "liger_fallback_forced": (
            liger_fallback,
            "Liger's torch fallback called directly (what non-Hopper GPUs and the CPU run)",
            "not used by stapo-trl on Hopper",
        ),
        "ours": (
            BACKENDS["torch"],
            "stapo-trl blocked op (fp32 blocks of 1024 tokens)",
            "forward, no grad (statistics pass, backend 'torch')",
        ),
    }


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_call(call, device: str, repeats: int, prepare=None) -> tuple[float, int | None, object]:
    """(median seconds over ``repeats`` after one warm-up, the largest peak of device memory above the memory held
    before the call in bytes (None on the CPU), the last result). ``prepare`` runs before each call, untimed."""
    result = call()
    del result
    times, peaks = [], []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        _synchronize(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        started = time.perf_counter()
        result = call()
        _synchronize(device)
        times.append(time.perf_counter() - started)
        if device == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - held)
    return statistics.median(times), (max(peaks) if peaks else None), result


def check_values(section, name: str, log_probs, entropies, reference: dict) -> None:
    exact_entropies = reference["entropies"]
    errors = {
        "log p": (
            (log_probs.double() - reference["log_probs"]).abs(),
            2 * BF16_UNIT_ROUNDOFF * reference["log_prob_sensitivity"],
        ),
        "H": (
            (entropies.double() - exact_entropies).abs(),
            BF16_UNIT_ROUNDOFF * (2 * reference["entropy_sensitivity"] + exact_entropies.abs()),
        ),
    }
    for quantity, (error, bound) in errors.items():
        bound = bound + ARITHMETIC_SLACK
        worst = float((error / bound).max())
        section.record(
            f"{name} {quantity} max error vs fp64",
            float(error.max()),
            "nats",
            f"per token <= 2 x its bf16-logit bound + 1e-3 (median bound {float(bound.median()):.3g})",
            worst <= 1.0,
            f"worst token at {worst:.2f} of its bound; median error {float(error.median()):.2g}",
        )


def check_gradients(section, name: str, grad_hidden, grad_weight, reference: dict) -> None:
    for quantity, value, exact, rounded in (
        ("grad hidden", grad_hidden, reference["grad_hidden"], reference["grad_hidden_rounded"]),
        ("grad weight", grad_weight, reference["grad_weight"], reference["grad_weight_rounded"]),
    ):
        baseline = relative_error(rounded, exact)
        tolerance = 2 * baseline + 2 * BF16_UNIT_ROUNDOFF
        error = relative_error(value, exact)
        section.record(
            f"{name} {quantity} relative error vs fp64",
            error,
            "",
            f"<= {tolerance:.3g} (2 x bf16-logit baseline {baseline:.3g} + 2**-7)",
            error <= tolerance,
        )


def check_memory(section, name: str, phase: str, peak: int | None, logits_bytes: int, weight_bytes: int) -> None:
    if peak is None:
        section.record(
            f"{name} {phase} peak memory",
            None,
            "",
            "",
            None,
            "not measured on the CPU (torch.cuda.max_memory_allocated only)",
            status="not_measured",
        )
        return
    section.record(
        f"{name} {phase} peak memory",
        round(peak / 2**20, 1),
        "MiB",
        f"< one bf16 [N, V] tensor ({logits_bytes / 2**20:.0f} MiB): no logits materialised",
        peak < logits_bytes,
        f"{peak / logits_bytes:.2f} of [N, V] bf16; {peak / weight_bytes:.1f} x the bf16 weight",
    )


def measure_kernel(section, name: str, function, inputs: dict, reference: dict, repeats: int) -> None:
    device = section.device
    hidden, weight, targets, upstream = inputs["hidden"], inputs["weight"], inputs["targets"], inputs["upstream"]
    logits_bytes = hidden.shape[0] * weight.shape[0] * 2
    weight_bytes = weight.numel() * 2

    def forward():
        with torch.no_grad():
            return function(hidden, weight, targets)

    seconds, peak, (log_probs, entropies) = measure_call(forward, device, repeats)
    section.record(f"{name} forward time", round(seconds * 1000, 2), "ms", "", None, f"median of {repeats}")
    check_memory(section, name, "forward", peak, logits_bytes, weight_bytes)
    check_values(section, name, log_probs, entropies, reference)
    del log_probs, entropies

    trained_hidden = hidden.detach().clone().requires_grad_()
    trained_weight = weight.detach().clone().requires_grad_()

    def clear_gradients():
        trained_hidden.grad = trained_weight.grad = None

    def forward_backward():
        log_probs, _ = function(trained_hidden, trained_weight, targets)
        (upstream * log_probs).sum().backward()
        return trained_hidden.grad, trained_weight.grad

    seconds, peak, (grad_hidden, grad_weight) = measure_call(forward_backward, device, repeats, clear_gradients)
    section.record(f"{name} forward+backward time", round(seconds * 1000, 2), "ms", "", None, f"median of {repeats}")
    check_memory(section, name, "forward+backward", peak, logits_bytes, weight_bytes)
    check_gradients(section, name, grad_hidden, grad_weight, reference)


def run(section, plan, environment: dict) -> None:
    shape = plan.kernel
    section.note("shape", {"tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab, "dtype": "bf16"})
    inputs = make_inputs(shape.tokens, shape.hidden, shape.vocab, section.device)
    started = time.perf_counter()
    reference = fp64_reference(inputs, shape.reference_rows)
    section.record("fp64 reference", round(time.perf_counter() - started, 2), "s", "", None, "chunked, not timed")
    section.note("entropy range", [float(reference["entropies"].min()), float(reference["entropies"].max())])
    section.note("largest log p sensitivity |z_y| + E_p|z|", float(reference["log_prob_sensitivity"].max()))

    for name, (function, path, use) in kernel_functions(environment).items():
        section.clock.require(5, f"the {name} kernel")
        section.note(f"{name} path", {"path": path, "training uses": use})
        liger_problem = environment.get("liger_problem")
        liger_missing = environment.get("liger_path") == "not installed"
        if name.startswith("liger") and liger_problem and (name == "liger" or liger_missing):
            section.skip(f"{name} kernel", f"cannot run here: {liger_problem}")
            continue
        try:
            measure_kernel(section, name, function, inputs, reference, shape.repeats)
        except Exception as error:
            section.record(
                f"{name} kernel runs", f"{type(error).__name__}", "", "runs", False, str(error).splitlines()[0][:300]
            )
        finally:
            if section.on_cuda:
                torch.cuda.empty_cache()
