"""How verl's batching shapes the S2T pool and the token-mean denominator, pinned on hand-computed batches.

verl calls the policy loss once per micro-batch, and back-propagates each before the next is computed, so the S2T
loss pools the candidates of one micro-batch of every data-parallel rank, not of the whole mini-batch (optimizer
step). The two coincide when each rank has one micro-batch per mini-batch. Here row 0 has candidates with
H = 0.1 ... 0.5 and row 1 candidates with H = 1 and 2 (all p = 0.001, A > 0):

- pooled together (the step's pool): tau_h = 0.8-quantile of [0.1 ... 0.5, 1, 2] = 0.5 + 0.8 * 0.5 = 0.9, which
  silences row 0 whole and nothing of row 1;
- pooled per row: tau_h = 0.42 for row 0 (4 of 5 silenced) and 1.8 for row 1 (1 of 2 silenced).
"""

import math

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from verl_loss_calls import metric, verl_loss  # noqa: E402

LOW = math.log(0.001)
LOG_PROBS = torch.full((2, 5), LOW, dtype=torch.float64)
ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
RESPONSE_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
ADVANTAGES = [1.0, 3.0]
STEP_POOL = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
ROW_POOLS = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)


def silenced(gradient):
    return (gradient == 0) & RESPONSE_MASK.bool()


def test_one_micro_batch_per_mini_batch_pools_the_whole_step():
    _, gradient, (metrics,) = verl_loss(LOG_PROBS, ENTROPIES, ADVANTAGES, RESPONSE_MASK, "stapo", micro_batch_size=2)
    assert torch.equal(silenced(gradient), STEP_POOL)
    assert metric(metrics, "actor/s2t/entropy_threshold") == pytest.approx(0.9)


def test_several_micro_batches_pool_each_alone():
    _, gradient, metrics = verl_loss(LOG_PROBS, ENTROPIES, ADVANTAGES, RESPONSE_MASK, "stapo", micro_batch_size=1)
    assert torch.equal(silenced(gradient), ROW_POOLS)
    thresholds = [metric(micro_metrics, "actor/s2t/entropy_threshold") for micro_metrics in metrics]
    assert thresholds == [pytest.approx(0.42), pytest.approx(1.8)]


def test_token_mean_subtracts_each_micro_batch_s_silenced_tokens_from_the_mini_batch_count():
    """The mini-batch has 7 loss tokens. Micro-batch 0 silences 4 and keeps 1 token (A = 1): divided by 7 - 4 = 3.
    Micro-batch 1 silences 1 and keeps 1 (A = 3): divided by 7 - 1 = 6. The step keeps 2 tokens, so the exact
    renormalization would divide both by 2: with several micro-batches the denominator is exact only to within the
    step's silenced share (here large; under 1% of tokens on real rollouts)."""
    losses, _, _ = verl_loss(LOG_PROBS, ENTROPIES, ADVANTAGES, RESPONSE_MASK, "stapo", micro_batch_size=1)
    assert [loss.item() for loss in losses] == [pytest.approx(-1.0 / 3), pytest.approx(-3.0 / 6)]
    losses, _, _ = verl_loss(LOG_PROBS, ENTROPIES, ADVANTAGES, RESPONSE_MASK, "stapo", micro_batch_size=2)
    assert [loss.item() for loss in losses] == [pytest.approx(-(0 * 1.0 + 2 * 3.0) / 2)]


def _data_parallel_rank(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        row = slice(rank, rank + 1)
        losses, gradient, metrics = verl_loss(
            LOG_PROBS[row],
            ENTROPIES[row],
            ADVANTAGES[row],
            RESPONSE_MASK[row],
            "stapo",
            dp_size=2,
            batch_num_tokens=int(RESPONSE_MASK.sum()),
            global_batch_size=2,
        )
        torch.save(
            {"loss": losses[0], "gradient": gradient, "tau_h": metric(metrics[0], "actor/s2t/entropy_threshold")},
            f"{results}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_pool_together_and_match_one_process(tmp_path):
    """Two ranks of one row each (one micro-batch per rank, as verl's engine runs them): the pool spans both ranks,
    so the mask and tau_h are the step's. verl's data-parallel gradient is the mean of the ranks' gradients; it
    equals one process holding both rows."""
    mp.spawn(_data_parallel_rank, args=(tmp_path / "init", tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    gradient = torch.cat([result["gradient"] for result in ranks]) / 2
    assert torch.equal(silenced(gradient), STEP_POOL)
    assert [result["tau_h"] for result in ranks] == [pytest.approx(0.9)] * 2
    (one_process_loss,), one_process_gradient, _ = verl_loss(
        LOG_PROBS, ENTROPIES, ADVANTAGES, RESPONSE_MASK, "stapo", micro_batch_size=2
    )
    torch.testing.assert_close(gradient, one_process_gradient, rtol=0, atol=1e-12)
    assert sum(result["loss"] for result in ranks).item() / 2 == pytest.approx(one_process_loss.item(), abs=1e-12)
