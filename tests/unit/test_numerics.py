"""Numerical edge cases of the statistics and the token rules (docs/records/numerics.md).

- An empty candidate pool silences nothing and leaves TRL's loss and gradient bit for bit as they were.
- A silenced token contributes exactly nothing to the gradient, whatever its ratio and advantage. The fully silenced
  micro-batch is ``test_an_all_masked_micro_batch_gives_finite_zero_loss_and_zero_gradient`` in
  tests/unit/test_renormalization.py.
- Non-finite statistics from degenerate logits are a defined case: never a candidate, never silenced, never pooled.
- Statistics from bf16 inputs give the fp32 mask up to tokens within the bf16 error of a threshold.
- A long completion never holds ``[N, V]`` logits: peak memory, measured in fresh processes, stays far below one
  ``[N, V]`` fp32 tensor and below the naive path at an eighth of the tokens.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loss_batches import HIGH, LOW, make_batch, make_trainer

from stapo_trl import spurious_token_mask
from stapo_trl.core.names import SILENCED_KEY
from stapo_trl.core.token_rules import stare_token_weights
from stapo_trl.core.token_stats.backends import BACKENDS

NAN, INF = float("nan"), float("inf")
LOG_TAU_P = math.log(0.002)


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def logit_entropy(logits):
    """Entropy in nats of softmax(logits), in float64."""
    log_softmax = torch.tensor(logits, dtype=torch.float64).log_softmax(-1)
    return float(-(log_softmax.exp() * log_softmax).sum())


def grad_factor(advantage, log_prob, entropy):
    """One token's term of ``spurious_logit_grad_sq_share_estimate``: A**2 (1 - 2p + max(p**2, exp(-H)))."""
    p = math.exp(log_prob)
    return advantage**2 * (1 - 2 * p + max(p * p, math.exp(-entropy)))


# ---------------------------------------------------------------- an empty candidate pool


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    ("log_probs", "entropies", "loss_mask"),
    [
        pytest.param([HIGH, HIGH, HIGH], [0.1, 0.2, 0.3], [1, 1, 1], id="no-token-below-tau_p"),
        pytest.param([LOW, LOW, HIGH], [NAN, INF, 0.3], [1, 1, 1], id="candidates-without-finite-entropy"),
        pytest.param([LOW, LOW, LOW], [0.1, 0.2, 0.3], [0, 0, 0], id="no-loss-token"),
    ],
)
def test_an_empty_pool_silences_nothing_and_every_statistic_is_defined(log_probs, entropies, loss_mask):
    spurious, stats = spurious_token_mask(row(log_probs), row(entropies), torch.tensor([1.0]), row(loss_mask))
    assert spurious.dtype == torch.bool and not spurious.any()
    assert stats["num_tokens"] == sum(loss_mask)
    assert stats["num_candidates"] == stats["num_spurious"] == 0
    assert math.isnan(stats["entropy_threshold"])
    assert stats["spurious_fraction"] == 0.0 and stats["spurious_logit_grad_sq_share_estimate"] == 0.0
    finite_entropies = [h for h, m in zip(entropies, loss_mask, strict=True) if m and math.isfinite(h)]
    assert math.isnan(stats["entropy_p50"]) == (not finite_entropies)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_an_empty_pool_leaves_the_loss_and_gradient_bit_for_bit_unchanged(tmp_path, loss_type):
    trainer = make_trainer(tmp_path, loss_type=loss_type)
    log_probs = torch.tensor([[HIGH, HIGH, HIGH], [LOW, LOW, LOW]])
    entropies = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
    ruled, untouched = (make_batch(log_probs, entropies, [1.0, -0.5]) for _ in range(2))
    stats = trainer.apply_token_rules([ruled])["s2t"]
    assert stats["num_candidates"] == 0 and math.isnan(stats["entropy_threshold"])
    assert not ruled[SILENCED_KEY].any()
    assert ruled["num_items_in_batch"].item() == untouched["num_items_in_batch"].item() == 6

    ruled_loss, ruled_grads = loss_and_grads(trainer, ruled)
    untouched_loss, untouched_grads = loss_and_grads(trainer, untouched)
    assert torch.isfinite(ruled_loss) and torch.equal(ruled_loss, untouched_loss)
    assert len(ruled_grads) == len(untouched_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(ruled_grads, untouched_grads, strict=True))


# ---------------------------------------------------------------- silenced tokens carry no gradient


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_silenced_token_contributes_exactly_zero_whatever_its_ratio_and_advantage(tmp_path, loss_type):
    trainer = make_trainer(tmp_path, loss_type=loss_type)
    batch = make_batch(
        torch.tensor([[LOW, HIGH, LOW], [LOW, LOW, LOW]]), torch.tensor([[0.1, 0.3, 0.5], [0.0] * 3]), [1.0, -0.5]
    )
    trainer.apply_token_rules([batch])
    silenced = batch[SILENCED_KEY]
    assert silenced.tolist() == [[True, False, False], [False, False, False]]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        model_log_probs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 3)
    per_token_advantages = batch["advantages"].unsqueeze(1).expand(-1, 3)

    def perturbed(where, shift, advantage_scale):
        changed = dict(batch)
        changed["old_per_token_logps"] = model_log_probs + shift * where
        changed["advantages"] = torch.where(where, per_token_advantages * advantage_scale, per_token_advantages)
        return loss_and_grads(trainer, changed)

    reference_loss, reference_grads = perturbed(silenced, 0.0, 1.0)
    for shift, advantage_scale in [(0.15, 1.0), (-0.15, 1.0), (30.0, -100.0), (-30.0, 100.0)]:
        loss, grads = perturbed(silenced, shift, advantage_scale)
        assert torch.equal(loss, reference_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads, strict=True))

    kept_token = torch.zeros_like(silenced)
    kept_token[0, 2] = True
    _, grads = perturbed(kept_token, 0.15, 1.0)
    assert not all(torch.equal(a, b) for a, b in zip(grads, reference_grads, strict=True))


# ---------------------------------------------------------------- non-finite statistics

IDENTITY = torch.eye(4)


@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize(
    ("hidden", "weight", "bias", "target", "log_prob", "entropy"),
    [
        pytest.param([[1e30, 0, 0, 0]], IDENTITY, None, 1, -1e30, 0.0, id="huge-but-representable-logits"),
        # exp(z - max) is exactly one-hot in fp32, so H = 0 as TRL's and Liger's ops give it; the naive path's
        # -sum p log p meets 0 * (-inf) = NaN.
        pytest.param(
            [[3e38, -3e38, 0, 0]], IDENTITY, None, 1, -INF, {"torch": 0.0, "naive": NAN}, id="logit-spread-beyond-fp32"
        ),
        pytest.param([[INF, 0, 0, 0]], IDENTITY, None, 0, NAN, NAN, id="infinite-hidden-state"),
        pytest.param(
            [[1, 0.5, 0, 0]],
            IDENTITY,
            [0, 0, 0, -INF],
            0,
            1 - math.log(math.e + math.exp(0.5) + 1),
            NAN,
            id="minus-inf-bias-entry",
        ),
        pytest.param(
            torch.tensor([[1e30, 0, 0, 0]]).bfloat16(),
            (IDENTITY * 1e30).bfloat16(),
            None,
            1,
            NAN,
            NAN,
            id="bf16-product-overflows-fp32",
        ),
        pytest.param(
            torch.tensor([[6e4, 0, 0, 0]]).half(),
            (IDENTITY * 6e4).half(),
            None,
            1,
            -3.6e9,
            0.0,
            id="fp16-product-is-computed-in-fp32",
        ),
    ],
)
def test_what_a_backend_returns_for_a_degenerate_row(backend, hidden, weight, bias, target, log_prob, entropy):
    hidden = hidden if torch.is_tensor(hidden) else torch.tensor(hidden, dtype=torch.float32)
    bias = None if bias is None else torch.tensor(bias, dtype=torch.float32)
    entropy = entropy[backend] if isinstance(entropy, dict) else entropy
    log_probs, entropies = BACKENDS[backend](hidden, weight, torch.tensor([target]), bias=bias)
    assert log_probs.item() == pytest.approx(log_prob, rel=1e-5, nan_ok=True)
    assert entropies.item() == pytest.approx(entropy, abs=1e-12, nan_ok=True)


def test_degenerate_rows_are_never_silenced_and_leave_the_other_tokens_mask_alone():
    # Rows 0-3 put logit k on token 0 and read token 1: p = 1 / (e^k + 3) < 0.002. Row 4 has huge but finite logits.
    logits = [[8.0, 0, 0, 0], [9.0, 0, 0, 0], [10.0, 0, 0, 0], [7.0, 0, 0, 0], [1e30, 0, 0, 0]]
    degenerate = [[3e38, -3e38, 0, 0], [INF, 0, 0, 0]]
    # The naive path gives row 5 a NaN entropy (the torch backend, TRL and Liger give it H = 0, a defined value).
    log_probs, entropies = BACKENDS["naive"](
        torch.tensor(logits + degenerate), IDENTITY, torch.ones(7, dtype=torch.long)
    )
    assert log_probs[5].item() == -INF and math.isnan(entropies[5].item())
    assert math.isnan(log_probs[6].item()) and math.isnan(entropies[6].item())

    spurious, stats = spurious_token_mask(log_probs[None], entropies[None], torch.tensor([1.0]), torch.ones(1, 7))
    pool = sorted([logit_entropy(z) for z in logits[:4]] + [0.0])
    assert stats["num_tokens"] == 7 and stats["num_candidates"] == 5
    assert stats["entropy_threshold"] == pytest.approx(pool[3] + 0.2 * (pool[4] - pool[3]), rel=1e-4)
    assert spurious.tolist() == [[True, True, True, False, True, False, False]]
    finite_only, finite_stats = spurious_token_mask(
        log_probs[None, :5], entropies[None, :5], torch.tensor([1.0]), torch.ones(1, 5)
    )
    assert torch.equal(spurious[:, :5], finite_only)
    assert finite_stats["spurious_logit_grad_sq_share_estimate"] == pytest.approx(
        stats["spurious_logit_grad_sq_share_estimate"], rel=1e-12
    )
    assert stats["entropy_p50"] == pytest.approx(finite_stats["entropy_p50"])


@pytest.mark.parametrize(
    ("entropy", "factor_in_share"),
    [(NAN, 0.0), (INF, (1 - 0.001) ** 2), (-INF, 0.0)],
    ids=["nan", "inf", "minus-inf"],
)
def test_a_non_finite_entropy_is_kept_and_stays_out_of_the_pool(entropy, factor_in_share):
    # Pool [0.1, 0.2, 0.9]: tau_h = 0.2 + 0.6 * (0.9 - 0.2) = 0.62. For H = inf the factor is 1 - 2p + p**2; for
    # NaN and -inf it is not finite and leaves the share.
    spurious, stats = spurious_token_mask(
        row([LOW] * 4), row([entropy, 0.1, 0.2, 0.9]), torch.tensor([1.0]), torch.ones(1, 4)
    )
    assert spurious.tolist() == [[False, True, True, False]]
    assert stats["num_tokens"] == 4 and stats["num_candidates"] == 3 and stats["num_spurious"] == 2
    assert stats["entropy_threshold"] == pytest.approx(0.62)
    assert stats["entropy_p50"] == pytest.approx(0.2)
    factors = [grad_factor(1.0, LOW, h) for h in (0.1, 0.2, 0.9)]
    expected_share = (factors[0] + factors[1]) / (sum(factors) + factor_in_share)
    assert stats["spurious_logit_grad_sq_share_estimate"] == pytest.approx(expected_share, rel=1e-6)


def test_a_nan_log_prob_is_never_a_candidate_and_minus_inf_is_p_zero():
    # Token 0 (NaN) is no candidate; token 1 (p = 0) is. Pool [0.1, 0.2, 0.9]: tau_h = 0.62.
    spurious, stats = spurious_token_mask(
        row([NAN, -INF, LOW, LOW]), row([0.05, 0.1, 0.2, 0.9]), torch.tensor([1.0]), torch.ones(1, 4)
    )
    assert spurious.tolist() == [[False, True, True, False]]
    assert stats["num_candidates"] == 3 and stats["entropy_threshold"] == pytest.approx(0.62)
    factors = [grad_factor(1.0, -INF, 0.1), grad_factor(1.0, LOW, 0.2), grad_factor(1.0, LOW, 0.9)]
    assert stats["spurious_logit_grad_sq_share_estimate"] == pytest.approx(
        (factors[0] + factors[1]) / sum(factors), rel=1e-6
    )


def test_stare_sizes_its_selection_from_the_finite_surprisals_and_ranks_p_zero_first():
    # Eleven positive tokens, one NaN: k = ceil(0.1 * 10) = 1, not ceil(0.1 * 11) = 2.
    probabilities = [0.01, 0.02, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    log_probs = torch.cat([torch.tensor([NAN, -INF]), torch.tensor(probabilities).log()]).unsqueeze(0)
    result = stare_token_weights(log_probs, torch.tensor([1.0]), torch.ones(1, 11))
    assert result.selected_positive[0].nonzero().flatten().tolist() == [1]
    assert result.weights[0, :3].tolist() == pytest.approx([1.0, 1.1, 1.0])
    assert math.isfinite(result.stats["mean_weight"])


def test_the_stare_gate_entropy_averages_only_finite_entropies(tmp_path):
    trainer = make_trainer(tmp_path)
    batch = make_batch(torch.full((2, 3), LOW), torch.tensor([[NAN, 0.2, 0.4], [INF, 0.0, 0.6]]), [1.0, -1.0])
    assert trainer._mean_token_entropy(batch) == pytest.approx(0.3)
    batch = make_batch(torch.full((1, 2), LOW), torch.tensor([[NAN, INF]]), [1.0])
    assert math.isnan(trainer._mean_token_entropy(batch))


# ---------------------------------------------------------------- bf16 against fp32 statistics

BF16_TOKENS, BF16_HIDDEN, BF16_VOCAB, BF16_ROW = 4096, 64, 8192, 64


def llm_like_batch(seed=0):
    """Hidden states and an LM head whose next-token distributions look like a trained model's: each position puts
    a logit boost of 4 to 28 (skewed high) on one token over Gaussian logits of scale 1 to 3, so |logit| <= ~40,
    median entropy ~0.02 nats, and ~7% of sampled tokens have p < 0.002. Targets are sampled from the distribution;
    each row of 64 tokens gets one advantage."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(BF16_VOCAB, BF16_HIDDEN, generator=generator) / BF16_HIDDEN**0.5
    scale = torch.empty(BF16_TOKENS, 1).uniform_(0, math.log(3), generator=generator).exp()
    boost = 4 + 24 * torch.rand(BF16_TOKENS, 1, generator=generator) ** 0.5
    top = torch.randint(0, BF16_VOCAB, (BF16_TOKENS,), generator=generator)
    direction = weight[top] / weight[top].square().sum(-1, keepdim=True)
    hidden = torch.randn(BF16_TOKENS, BF16_HIDDEN, generator=generator) * scale + boost * direction
    probs = (hidden @ weight.T).softmax(-1)
    targets = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    advantages = torch.randn(BF16_TOKENS // BF16_ROW, generator=generator)
    return hidden, weight, targets, advantages


def test_bf16_statistics_give_the_fp32_mask_up_to_tokens_within_the_bf16_error_of_a_threshold():
    hidden, weight, targets, advantages = llm_like_batch()
    shape = (BF16_TOKENS // BF16_ROW, BF16_ROW)
    loss_mask = torch.ones(shape)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            log_probs, entropies = BACKENDS["torch"](hidden.to(dtype), weight.to(dtype), targets)
        spurious, stats = spurious_token_mask(log_probs.view(shape), entropies.view(shape), advantages, loss_mask)
        results[dtype] = log_probs.view(shape), entropies.view(shape), spurious, stats
    lp32, h32, mask32, stats32 = results[torch.float32]
    lp16, h16, mask16, stats16 = results[torch.bfloat16]

    max_log_prob_error = (lp32 - lp16).abs().max().item()
    max_entropy_error = (h32 - h16).abs().max().item()
    assert 0 < max_log_prob_error < 0.1 and 0 < max_entropy_error < 0.1
    assert stats32["num_spurious"] >= 50

    positive = (advantages > 0).unsqueeze(1)
    assert torch.equal(positive & (lp32 < LOG_TAU_P), positive & (lp16 < LOG_TAU_P))
    threshold_shift = abs(stats32["entropy_threshold"] - stats16["entropy_threshold"])
    assert threshold_shift <= max_entropy_error

    disagree = mask32 ^ mask16
    near_tau_h = (h32 - stats32["entropy_threshold"]).abs() <= max_entropy_error + threshold_shift
    near_tau_p = (lp32 - LOG_TAU_P).abs() <= max_log_prob_error
    assert torch.all(near_tau_h[disagree] | near_tau_p[disagree])
    assert disagree.sum().item() <= 0.02 * stats32["num_spurious"]


# ---------------------------------------------------------------- a very long completion

MEMORY_BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_numerics.py"
LONG_TOKENS, SHORT_TOKENS, MEMORY_HIDDEN, MEMORY_VOCAB = 32768, 4096, 64, 8192


def peak_training_memory(method, tokens):
    """Growth of peak RSS in bytes over one forward and backward, in a fresh process, above the RSS held with the
    inputs allocated (the benchmark's memory worker: VmHWM reset through /proc/self/clear_refs after a tiny warm-up)."""
    command = [sys.executable, str(MEMORY_BENCHMARK), "--worker", method, str(tokens)]
    command += [str(MEMORY_HIDDEN), str(MEMORY_VOCAB)]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    assert result["finite"]
    return result["peak_mib"] * 2**20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak RSS")
def test_a_long_completion_never_materializes_n_by_v_logits():
    one_logits_tensor = LONG_TOKENS * MEMORY_VOCAB * 4
    vocab_row = MEMORY_VOCAB * 4
    naive_short = peak_training_memory("naive", SHORT_TOKENS)
    chunked_short = peak_training_memory("torch", SHORT_TOKENS)
    chunked_long = peak_training_memory("torch", LONG_TOKENS)

    assert naive_short >= 3 * SHORT_TOKENS * vocab_row
    assert chunked_long < one_logits_tensor / 8
    assert chunked_long < naive_short
    assert chunked_long - chunked_short < (LONG_TOKENS - SHORT_TOKENS) * vocab_row / 32
