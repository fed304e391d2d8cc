"""The CPU LM head (`stapo_trl.cpu.lm_head`) gives TRL's fused-head results: log-probabilities, entropies and gradients
match TRL's own `ChunkedLogProbFunction` torch fallback to float tolerance, through the op and through a model patched
by `add_fused_lm_head`; it is opt-in and can be turned off."""

import inspect
import subprocess
import sys

import pytest
import torch
import trl.trainer.utils as trl_utils
from tiny import build_char_tokenizer, build_tiny_qwen3
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head

from stapo_trl.cpu.lm_head import (
    CPULogProbEntropy,
    FusedHeadOp,
    apply_cpu_lm_head,
    cpu_lm_head,
    cpu_logprob_entropy,
    is_cpu_lm_head_applied,
    revert_cpu_lm_head,
)
from stapo_trl.trl_boundary.drift_checks import SEAMS
from stapo_trl.trl_boundary.patches import install_fused_head_op

TRL_VOCAB_TILE = 32
"""TRL's vocabulary tile in these tests: several tiles over the 101-entry vocabulary, the last one partial."""


@pytest.fixture(autouse=True)
def trl_head_afterwards():
    yield
    revert_cpu_lm_head()


def make_problem(num_tokens=37, hidden=16, vocab=101, seed=0, with_bias=False):
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(num_tokens, hidden, generator=generator) * 2,
        "weight": torch.randn(vocab, hidden, generator=generator),
        "bias": torch.randn(vocab, generator=generator) if with_bias else None,
        "targets": torch.randint(0, vocab, (num_tokens,), generator=generator),
        "grad_log_probs": torch.randn(num_tokens, generator=generator),
        "grad_entropies": torch.randn(num_tokens, generator=generator),
    }


def run_op(op, problem, *, temperature, softcap, logit_scale, train_weight, entropy_grad, outputs=("entropy",)):
    """Values and gradients of ``op.apply`` (TRL's argument order) for one problem."""
    hidden = problem["hidden"].clone().requires_grad_()
    weight = problem["weight"].clone().requires_grad_(train_weight)
    bias = None if problem["bias"] is None else problem["bias"].clone().requires_grad_(train_weight)
    log_probs, entropies, *_ = op.apply(
        hidden, weight, bias, problem["targets"], temperature, TRL_VOCAB_TILE, softcap, logit_scale, outputs
    )
    objective = (log_probs * problem["grad_log_probs"]).sum()
    if entropy_grad:
        objective = objective + (entropies * problem["grad_entropies"]).sum()
    objective.backward()
    results = {"log_probs": log_probs, "entropies": entropies, "grad_hidden": hidden.grad}
    if train_weight:
        results["grad_weight"] = weight.grad
        if bias is not None:
            results["grad_bias"] = bias.grad
    return {name: value.detach() for name, value in results.items()}


def assert_close(got, want, context):
    """Equal up to fp32 rounding: within 1e-5 of each tensor's largest magnitude (TRL's fallback and the CPU head are
    each about 1e-6 of it from fp64; the entropy gradient cancels large terms)."""
    assert got.keys() == want.keys(), context
    for name in want:
        error = (got[name] - want[name]).abs().max().item()
        tolerance = 1e-5 * want[name].abs().max().item()
        assert error <= tolerance, f"{context}: {name} off by {error:.2e} (tolerance {tolerance:.2e})"


TRANSFORMS = [
    {"temperature": 1.0, "softcap": None, "logit_scale": 1.0},
    {"temperature": 0.7, "softcap": None, "logit_scale": 1.0},
    {"temperature": 1.0, "softcap": 3.0, "logit_scale": 1.0},
    {"temperature": 0.7, "softcap": 3.0, "logit_scale": 0.5},
    {"temperature": 1.3, "softcap": None, "logit_scale": 2.0},
]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize(
    ("with_bias", "train_weight", "entropy_grad", "keep_logits_bytes", "block_rows"),
    [
        (False, False, False, 1 << 30, 256),  # the quickstart: frozen head, entropy only logged, logits kept
        (False, False, True, 0, 8),  # recomputed in blocks of 8 rows
        (True, True, True, 1 << 30, 5),  # bias and weight trained, kept logits in uneven blocks
        (True, True, False, 0, 256),
    ],
)
def test_the_op_matches_trls_fallback(transform, with_bias, train_weight, entropy_grad, keep_logits_bytes, block_rows):
    problem = make_problem(with_bias=with_bias)
    options = {**transform, "train_weight": train_weight, "entropy_grad": entropy_grad}
    want = run_op(ChunkedLogProbFunction, problem, **options)
    op = FusedHeadOp(ChunkedLogProbFunction, block_rows=block_rows, keep_logits_bytes=keep_logits_bytes)
    got = run_op(op, problem, **options)
    assert_close(got, want, f"{options}, keep {keep_logits_bytes}, blocks of {block_rows}")


def test_the_kernel_matches_fp64_autograd():
    problem = make_problem(with_bias=True)
    hidden, weight, bias = (problem[name].double().requires_grad_() for name in ("hidden", "weight", "bias"))
    temperature, softcap, logit_scale = 0.7, 3.0, 0.5
    for kernel in (True, False):
        for tensor in (hidden, weight, bias):
            tensor.grad = None
        if kernel:
            log_probs, entropies = cpu_logprob_entropy(
                hidden, weight, problem["targets"], bias=bias, temperature=temperature, softcap=softcap,
                logit_scale=logit_scale, block_rows=6,
            )  # fmt: skip
        else:
            z = softcap * torch.tanh((hidden @ weight.T + bias) * logit_scale / softcap) / temperature
            log_softmax = z.log_softmax(-1)
            log_probs = log_softmax.gather(-1, problem["targets"].unsqueeze(-1)).squeeze(-1)
            entropies = -(log_softmax.exp() * log_softmax).sum(-1)
        objective = (log_probs * problem["grad_log_probs"].double()).sum()
        (objective + (entropies * problem["grad_entropies"].double()).sum()).backward()
        values = [log_probs, entropies, hidden.grad, weight.grad, bias.grad]
        if kernel:
            got = [value.detach().clone() for value in values]
    for name, mine, reference in zip(["log_probs", "entropies", "hidden", "weight", "bias"], got, values, strict=True):
        assert torch.allclose(mine, reference.detach(), rtol=1e-10, atol=1e-10), name


def test_no_entropy_when_not_asked_and_a_second_backward_gives_the_same_gradients():
    problem = make_problem()
    hidden = problem["hidden"].clone().requires_grad_()
    log_probs, entropies = cpu_logprob_entropy(hidden, problem["weight"], problem["targets"], want_entropy=False)
    assert entropies is None
    (log_probs * problem["grad_log_probs"]).sum().backward(retain_graph=True)
    first = hidden.grad.clone()
    hidden.grad = None
    (log_probs * problem["grad_log_probs"]).sum().backward()
    assert torch.allclose(hidden.grad, first, rtol=1e-6, atol=1e-6)


def test_no_tokens():
    hidden = torch.zeros(0, 16, requires_grad=True)
    log_probs, entropies = cpu_logprob_entropy(hidden, torch.randn(101, 16), torch.zeros(0, dtype=torch.long))
    assert log_probs.shape == entropies.shape == (0,)
    (log_probs.sum() + entropies.sum()).backward()
    assert hidden.grad.shape == (0, 16)


def test_other_outputs_and_autocast_go_to_trls_op():
    problem = make_problem()
    calls = []

    class Recording:
        @staticmethod
        def apply(*args):
            calls.append(args[-1])
            return ChunkedLogProbFunction.apply(*args)

    op = FusedHeadOp(Recording)
    args = (problem["hidden"], problem["weight"], None, problem["targets"], 1.0, TRL_VOCAB_TILE, None, 1.0)
    op.apply(*args, ("entropy",))
    assert calls == []
    result = op.apply(*args, ("entropy", "is_top1"))
    assert calls == [("entropy", "is_top1")] and result[4] is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        op.apply(*args, ("entropy",))
    assert len(calls) == 2
    op.apply(problem["hidden"].bfloat16(), problem["weight"].bfloat16(), *args[2:], ("entropy",))
    assert len(calls) == 3


# --- through a model patched by TRL's add_fused_lm_head ----------------------------------------------------------


def patched_model(temperature):
    model = build_tiny_qwen3(build_char_tokenizer(), seed=1)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def fused_pass(model, input_ids, labels, entropy_grad):
    model.zero_grad()
    output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels, fused_lm_head=True)
    objective = output.loss + (0.1 * output.entropy.sum() if entropy_grad else 0.0)
    objective.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return {"log_probs": output.log_probs, "entropy": output.entropy, "label_mask": output.label_mask}, grads


@pytest.mark.parametrize(("temperature", "entropy_grad"), [(1.0, False), (0.6, True)])
def test_a_patched_model_gives_the_same_results_and_gradients(temperature, entropy_grad):
    """Labels of -100 (the prompt, padding) are skipped by the CPU head and zeroed by TRL's: both give 0 there."""
    model = patched_model(temperature)
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 40, (3, 12), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100
    labels[2, 8:] = -100
    want, want_grads = fused_pass(model, input_ids, labels, entropy_grad)
    with cpu_lm_head():
        got, got_grads = fused_pass(model, input_ids, labels, entropy_grad)
    assert torch.equal(got["label_mask"], want["label_mask"])
    for name in ("log_probs", "entropy"):
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-5), name
        assert (got[name][~got["label_mask"]] == 0).all()
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name in want_grads:
        assert torch.allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6), name


def test_a_patched_model_without_any_label_still_backpropagates():
    model = patched_model(1.0)
    input_ids = torch.randint(3, 40, (2, 6))
    with cpu_lm_head():
        output = model(input_ids=input_ids, labels=torch.full_like(input_ids, -100), fused_lm_head=True)
        output.loss.backward()
    assert (output.log_probs == 0).all()
    assert model.lm_head.weight.grad is not None and (model.lm_head.weight.grad == 0).all()


def test_the_cpu_head_scores_only_labelled_positions():
    model = patched_model(1.0)
    input_ids = torch.randint(3, 40, (2, 10))
    labels = input_ids.clone()
    labels[:, :7] = -100
    rows = []

    class Counting(FusedHeadOp):
        def apply(self, hidden, *args):
            rows.append(hidden.shape[0])
            return super().apply(hidden, *args)

    restore = install_fused_head_op(Counting(ChunkedLogProbFunction))
    try:
        model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    finally:
        restore()
    assert rows == [2 * 3]  # labels 7, 8 and 9 of each row, which positions 6, 7 and 8 predict


# --- opt-in, on and off ---------------------------------------------------------------------------------------------


def test_importing_stapo_trl_patches_nothing():
    code = (
        "import stapo_trl, stapo_trl.cpu.lm_head, stapo_trl.cpu.runtime, stapo_trl.core.trainer, stapo_trl.cli.train\n"
        "import trl.trainer.utils as u\n"
        "from trl.kernels import ChunkedLogProbFunction\n"
        "assert u._ChunkedLogProbFunction is ChunkedLogProbFunction, u._ChunkedLogProbFunction\n"
        "from trl.kernels.chunked_logprob import _use_triton\n"
        "assert u._use_triton is _use_triton\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_apply_revert_and_the_context_manager():
    trl_op, trl_compact = trl_utils._ChunkedLogProbFunction, trl_utils._use_triton
    assert not is_cpu_lm_head_applied()
    apply_cpu_lm_head(block_rows=64)
    assert isinstance(trl_utils._ChunkedLogProbFunction, FusedHeadOp)
    assert trl_utils._ChunkedLogProbFunction.fallback is trl_op and trl_utils._use_triton(torch.device("cpu"))
    apply_cpu_lm_head(block_rows=32)
    assert trl_utils._ChunkedLogProbFunction.fallback is trl_op, "applied twice, it wrapped itself"
    with cpu_lm_head(block_rows=16):
        assert trl_utils._ChunkedLogProbFunction.block_rows == 16
    assert trl_utils._ChunkedLogProbFunction.block_rows == 32
    revert_cpu_lm_head()
    assert trl_utils._ChunkedLogProbFunction is trl_op and trl_utils._use_triton is trl_compact
    with cpu_lm_head():
        assert is_cpu_lm_head_applied()
    assert not is_cpu_lm_head_applied() and trl_utils._ChunkedLogProbFunction is trl_op
    revert_cpu_lm_head()


def test_the_kernel_is_an_autograd_function():
    assert issubclass(CPULogProbEntropy, torch.autograd.Function)


# --- the seam ---------------------------------------------------------------------------------------------------


def test_the_seam_check_fails_when_trl_stops_compacting(monkeypatch):
    seam = next(seam for seam in SEAMS if seam.name == "install_fused_head_op")
    assert seam.check() == []
    real_getsource = inspect.getsource

    def getsource(obj):
        source = real_getsource(obj)
        return (
            source.replace("compact = _use_triton(hidden_states.device)", "compact = True")
            if (obj is add_fused_lm_head)
            else source
        )

    monkeypatch.setattr(inspect, "getsource", getsource)
    assert any("compact = _use_triton" in problem for problem in seam.check())


def test_the_seam_check_fails_when_the_op_signature_changes(monkeypatch):
    seam = next(seam for seam in SEAMS if seam.name == "install_fused_head_op")

    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        return None

    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(forward))
    assert any("ChunkedLogProbFunction.forward takes" in problem for problem in seam.check())
