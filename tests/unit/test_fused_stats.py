"""Every statistics backend matches naive fp64 autograd in values and in gradients."""

import math

import pytest
import torch

from stapo_trl import token_logprob_entropy
from stapo_trl.core.token_stats import liger_backend as liger_module
from stapo_trl.core.token_stats.backends import BACKENDS, naive_logprob_entropy, resolve_backend
from stapo_trl.core.token_stats.torch_backend import CPULogProbEntropy, blocked_logprob_entropy

TRAINING_BACKENDS = ["torch", "liger", "trl_fused_head"]


def make_problem(num_tokens=37, hidden=16, vocab=101, seed=0, scale=2.0):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64) * scale
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator)
    grad_log_probs = torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    grad_entropies = torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    return hidden_states, weight, targets, grad_log_probs, grad_entropies


def values_and_grads(function, hidden_states, weight, targets, grad_log_probs, grad_entropies, dtype, **kwargs):
    hidden_states = hidden_states.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    log_probs, entropies = function(hidden_states, weight, targets, **kwargs)
    objective = (log_probs.double() * grad_log_probs).sum() + (entropies.double() * grad_entropies).sum()
    objective.backward()
    return [t.detach().double() for t in (log_probs, entropies, hidden_states.grad, weight.grad)]


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_backend_matches_fp64_autograd(backend, temperature):
    problem = make_problem()
    reference = values_and_grads(naive_logprob_entropy, *problem, torch.float64, temperature=temperature)
    result = values_and_grads(BACKENDS[backend], *problem, torch.float32, temperature=temperature)
    for name, got, want in zip(
        ["log_probs", "entropies", "grad_hidden", "grad_weight"], result, reference, strict=True
    ):
        assert torch.allclose(got, want, rtol=1e-4, atol=2e-4), f"{backend}: {name} off by {(got - want).abs().max()}"


def test_reference_is_the_textbook_definition():
    # With an identity LM head the hidden states are the logits.
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    log_probs, entropies = naive_logprob_entropy(logits, torch.eye(3, dtype=torch.float64), torch.tensor([1, 0]))
    assert log_probs[0].item() == pytest.approx(2.0 - math.log(math.exp(1.0) + math.exp(2.0) + math.exp(0.5)))
    assert log_probs[1].item() == pytest.approx(-math.log(3))
    assert entropies[1].item() == pytest.approx(math.log(3))


@pytest.mark.parametrize("block_rows", [1, 5, 16, 512])
def test_blocked_backend_is_exact_in_fp64_at_any_block_size(block_rows):
    hidden_states, weight, targets, grad_log_probs, grad_entropies = make_problem(num_tokens=23)
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    reference = values_and_grads(
        naive_logprob_entropy, hidden_states, weight, targets, grad_log_probs, grad_entropies, torch.float64, bias=bias
    )
    result = values_and_grads(
        blocked_logprob_entropy,
        hidden_states,
        weight,
        targets,
        grad_log_probs,
        grad_entropies,
        torch.float64,
        bias=bias,
        block_rows=block_rows,
    )
    for got, want in zip(result, reference, strict=True):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)


def test_blocked_backend_passes_gradcheck_with_bias_and_temperature():
    hidden_states, weight, targets, *_ = make_problem(num_tokens=5, hidden=4, vocab=7)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    hidden_states.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w, b: CPULogProbEntropy.apply(h, w, b, targets, 1 / 0.7, None, 1.0, True, 2, 0),
        (hidden_states, weight, bias),
    )


@pytest.mark.parametrize("which", ["log_probs", "entropies"])
def test_blocked_backend_handles_a_single_output_gradient(which):
    hidden_states, weight, targets, *_ = make_problem(num_tokens=9)
    grads = {}
    for function in (naive_logprob_entropy, blocked_logprob_entropy):
        h = hidden_states.clone().requires_grad_()
        log_probs, entropies = function(h, weight, targets)
        (log_probs if which == "log_probs" else entropies).sum().backward()
        grads[function] = h.grad
    assert torch.allclose(grads[blocked_logprob_entropy], grads[naive_logprob_entropy], atol=1e-10)


def test_bf16_inputs_are_computed_in_fp32():
    hidden_states, weight, targets, *_ = make_problem(num_tokens=31)
    reference = naive_logprob_entropy(hidden_states.bfloat16().double(), weight.bfloat16().double(), targets)
    log_probs, entropies = blocked_logprob_entropy(hidden_states.bfloat16(), weight.bfloat16(), targets)
    assert log_probs.dtype == torch.float32 and entropies.dtype == torch.float32
    assert torch.allclose(log_probs.double(), reference[0], atol=1e-4)
    assert torch.allclose(entropies.double(), reference[1], atol=1e-4)


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
def test_dispatcher_skips_ignored_positions_and_keeps_leading_dims(backend):
    hidden_states, weight, targets, *_ = make_problem(num_tokens=12)
    hidden_states = hidden_states.float().view(3, 4, -1)
    targets = targets.view(3, 4).clone()
    targets[0, 3] = -100
    targets[2, :2] = -100
    log_probs, entropies = token_logprob_entropy(hidden_states, weight.float(), targets, backend=backend)
    assert log_probs.shape == entropies.shape == (3, 4)
    ignored = targets == -100
    assert torch.all(log_probs[ignored] == 0) and torch.all(entropies[ignored] == 0)
    want_log_probs, want_entropies = naive_logprob_entropy(hidden_states[~ignored].double(), weight, targets[~ignored])
    assert torch.allclose(log_probs[~ignored].double(), want_log_probs, atol=1e-4)
    assert torch.allclose(entropies[~ignored].double(), want_entropies, atol=1e-4)


def test_all_ignored_input_gives_zeros_that_stay_differentiable():
    hidden_states = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    targets = torch.full((2, 3), -100)
    log_probs, entropies = token_logprob_entropy(hidden_states, weight, targets, backend="torch")
    assert torch.all(log_probs == 0) and torch.all(entropies == 0)
    (log_probs.sum() + entropies.sum()).backward()
    assert torch.all(hidden_states.grad == 0)


def test_auto_picks_torch_on_cpu_and_liger_on_cuda(monkeypatch):
    assert resolve_backend("auto", "cpu") == "torch"
    monkeypatch.setattr(liger_module, "is_liger_available", lambda: True)
    assert resolve_backend("auto", "cuda") == "liger"
    assert resolve_backend("auto", "cuda", has_bias=True) == "torch"
    monkeypatch.setattr(liger_module, "is_liger_available", lambda: False)
    assert resolve_backend("auto", "cuda") == "torch"


def test_on_an_sm90_gpu_liger_needs_the_cute_dsl_package(monkeypatch):
    """liger-kernel 0.8.5 runs a CuTe DSL kernel on compute capability 9.0 and imports ``cutlass`` with no fallback:
    without nvidia-cutlass-dsl, 'auto' must not pick it, and an explicit 'liger' says what to install."""
    import importlib.util

    find_spec = importlib.util.find_spec
    cutlass_installed = [False]
    monkeypatch.setattr(liger_module, "is_liger_available", lambda: True)
    monkeypatch.setattr(liger_module, "takes_cute_dsl_kernel", lambda device: torch.device(device).type == "cuda")
    monkeypatch.setattr(
        liger_module.importlib.util,
        "find_spec",
        lambda name, *rest: (
            (find_spec("torch") if cutlass_installed[0] else None) if name == "cutlass" else find_spec(name, *rest)
        ),
    )
    assert resolve_backend("auto", "cuda") == "torch"
    with pytest.raises(ImportError, match=r"compute capability 9\.0.*pip install 'liger-kernel\[cutedsl\]'"):
        resolve_backend("liger", "cuda")
    assert resolve_backend("liger", "cpu") == "liger"  # Liger's torch fallback
    cutlass_installed[0] = True
    assert resolve_backend("auto", "cuda") == "liger"
    assert liger_module.liger_unavailable("cuda") is None


def test_no_gpu_takes_the_cute_dsl_kernel_here():
    assert not liger_module.takes_cute_dsl_kernel("cpu") and not liger_module.takes_cute_dsl_kernel(None)


def test_missing_liger_gives_an_install_hint(monkeypatch):
    monkeypatch.setattr(liger_module, "is_liger_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[liger\]'"):
        resolve_backend("liger", "cpu")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[liger\]'"):
        liger_module.liger_logprob_entropy(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long))


def test_the_backend_is_called_trl_fused_head_not_trl():
    with pytest.raises(ValueError, match="Unknown statistics backend 'trl'"):
        resolve_backend("trl", "cpu")


def test_bad_backend_input_is_rejected():
    with pytest.raises(ValueError, match="Unknown statistics backend 'cute'"):
        resolve_backend("cute", "cpu")
    with pytest.raises(ValueError, match="no bias term"):
        liger_module.liger_logprob_entropy(
            torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), bias=torch.zeros(3)
        )
    with pytest.raises(ValueError, match="must agree on the leading dimensions"):
        token_logprob_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprob_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), temperature=0)
