"""The paper's pool on verl: trainer mode ``stapo_sync`` takes S2T's ``tau_h`` over each whole mini-batch (optimizer
step) of every rank, from the old policy's statistics, on verl's driver, and verl's ``vanilla`` loss then trains on
the kept tokens with ``token-mean`` divided by the step's kept tokens.

The reference is stapo-trl's TRL trainer: its whole-step mask (``apply_token_rules`` over the step's micro-batches)
and TRL's ``dapo`` loss, on the same float64 tensors. verl's side runs the trainer's own ``_update_actor`` with the
driver's TransferQueue replaced by a dictionary and the actor workers by this process, which splits the batch and
calls verl's ``ppo_loss`` as verl's dispatch, ``TrainingWorker.train_mini_batch`` and the FSDP engine do (two
data-parallel ranks, computed one after the other). The log-probabilities are the old ones, so the ratio is 1.
"""

import math

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from loss_batches import make_batch, make_trainer  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl_loss_calls import actor_config  # noqa: E402

from stapo_trl.core.names import SILENCED_KEY  # noqa: E402
from stapo_trl.verl import pool_trainer  # noqa: E402
from stapo_trl.verl.actor_batch import actor_mini_batch, model_output  # noqa: E402
from stapo_trl.verl.losses import s2t_keep_rule  # noqa: E402
from stapo_trl.verl.mini_batch_pool import optimizer_step_rows, whole_step_keep  # noqa: E402
from stapo_trl.verl.pool_trainer import S2TPoolTrainer, check_pool_settings, mean_over_steps  # noqa: E402

ROWS, TOKENS, DP_SIZE = 8, 5, 2
ROLLOUT_N, PROMPTS_PER_STEP = 2, 2
STEP_ROWS = [[0, 1, 4, 5], [2, 3, 6, 7]]
"""Rank 0 holds rows 0-3 and rank 1 rows 4-7; each optimizer step takes 2 rows of each rank."""
ADVANTAGES = torch.tensor([1.5, 0.5, -1.0, 2.0, 1.0, 0.7, 1.2, -0.3], dtype=torch.float64)
RESPONSE_MASK = torch.tensor(
    [[1] * 5, [1, 1, 1, 1, 0], [1] * 5, [1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0], [1] * 5, [1] * 5]
)
THRESHOLDS = {"prob_threshold": 0.05, "entropy_quantile": 0.5}
KEEP_RULE = s2t_keep_rule(**THRESHOLDS)
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def old_statistics(seed=3):
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.empty(ROWS, TOKENS, dtype=torch.float64).uniform_(-6.9, -0.1, generator=generator)
    entropies = torch.empty(ROWS, TOKENS, dtype=torch.float64).uniform_(0.05, 3.0, generator=generator)
    return log_probs * RESPONSE_MASK, entropies * RESPONSE_MASK


def test_optimizer_step_rows_by_hand():
    """That verl splits this way, by its own code, is the drift check "pool trainer hooks" (test_drift.py)."""
    assert [rows.tolist() for rows in optimizer_step_rows(ROWS, DP_SIZE, 4)] == STEP_ROWS
    assert [rows.tolist() for rows in optimizer_step_rows(ROWS, 1, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rows.tolist() for rows in optimizer_step_rows(ROWS, 4, 8)] == [list(range(8))]
    with pytest.raises(ValueError, match="multiples of it"):
        optimizer_step_rows(ROWS, 3, 6)
    with pytest.raises(ValueError, match="holds 4 rows, which is not a whole number of mini-batches of 3 rows"):
        optimizer_step_rows(ROWS, 2, 6)


def verl_split(batch, dp_size, mini_batch_size):
    """verl's own split: the dispatch's contiguous chunk per rank, then ``TrainingWorker.train_mini_batch``'s
    ``make_iterator`` (seed + rank, no shuffle) per rank. Yields, per optimizer step, each rank's mini-batch."""
    chunks = tu.chunk_tensordict(batch, dp_size)
    per_rank = [
        list(
            tu.make_iterator(
                chunk,
                mini_batch_size=mini_batch_size // dp_size,
                epochs=1,
                seed=42 + rank,
                dataloader_kwargs={"shuffle": False},
            )
        )
        for rank, chunk in enumerate(chunks)
    ]
    return list(zip(*per_rank, strict=True))


def trl_step(tmp_path, log_probs, entropies, rows, leaf=None):
    """stapo-trl's TRL trainer on one optimizer step of ``rows``: two micro-batches of two rows, one generation per
    step (``num_items_in_batch`` is the step's loss tokens). Returns its mask, its loss and the batches."""
    trainer = make_trainer(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=TOKENS,
        loss_type="dapo",
        **THRESHOLDS,
    )
    step_tokens = torch.tensor(int(RESPONSE_MASK[rows].sum()))
    halves = [rows[:2], rows[2:]]
    batches = [
        make_batch(
            log_probs[half], entropies[half], ADVANTAGES[half].tolist(), RESPONSE_MASK[half].clone(), step_tokens
        )
        for half in halves
    ]
    trainer.apply_token_rules(batches)
    silenced = torch.cat([batch[SILENCED_KEY] for batch in batches])
    if leaf is None:
        return silenced, None
    model_pass = trainer._get_per_token_logps_and_entropies
    loss = 0
    for half, batch in zip(halves, batches, strict=True):

        def given(*args, half=half, **kwargs):
            _, model_entropies, aux = model_pass(*args, **kwargs)
            return leaf[half], None if model_entropies is None else entropies[half], aux

        trainer._get_per_token_logps_and_entropies = given
        loss = loss + trainer.compute_loss(trainer.model, batch)
    return silenced, loss


def test_the_whole_step_mask_is_trl_s_whole_step_mask(tmp_path):
    log_probs, entropies = old_statistics()
    mask = whole_step_keep(
        log_probs, entropies, ADVANTAGES, RESPONSE_MASK, optimizer_step_rows(ROWS, DP_SIZE, 4), KEEP_RULE
    )
    silenced_by_step = []
    for rows in STEP_ROWS:
        trl_silenced, _ = trl_step(tmp_path, log_probs, entropies, rows)
        assert torch.equal(RESPONSE_MASK[rows].bool() & ~mask.keep[rows], trl_silenced)
        silenced_by_step.append(int(trl_silenced.sum()))
    assert all(count > 0 for count in silenced_by_step)
    assert [stats["num_silenced"] for stats in mask.step_stats] == silenced_by_step
    per_micro_batch = whole_step_keep(
        log_probs, entropies, ADVANTAGES, RESPONSE_MASK, [torch.tensor([row]) for row in range(ROWS)], KEEP_RULE
    )
    assert not torch.equal(per_micro_batch.keep, mask.keep), "the test batch must tell the two pools apart"


class FakeTransferQueue:
    """The driver's TransferQueue for one batch: ``kv_batch_get`` and ``kv_batch_put`` over a dictionary of fields,
    recording what each put wrote."""

    def __init__(self, keys, fields):
        self.keys, self.fields, self.puts = keys, fields, []

    def kv_batch_get(self, keys, partition_id, select_fields):
        assert keys == self.keys and partition_id == "train"
        return self.fields.select(*select_fields)

    def kv_batch_put(self, keys, partition_id, fields):
        assert keys == self.keys and partition_id == "train"
        self.puts.append(fields)
        for name, value in fields.items():
            self.fields[name] = value


class ActorWorkers:
    """The actor worker group, in this process: ``update_actor`` reads the batch from the queue, splits it as verl's
    dispatch and ``train_mini_batch`` do, sets ``batch_num_tokens`` as the FSDP engine does (the mini-batch's
    ``loss_mask`` tokens, summed over ranks) and back-propagates verl's ``ppo_loss`` of each micro-batch into ``leaf``."""

    def __init__(self, queue, leaf, entropies):
        self._dispatch_info = {"actor": list(range(DP_SIZE))}
        self.queue, self.leaf, self.entropies = queue, leaf, entropies
        self.seen_response_masks, self.step_losses = [], []

    def update_actor(self, batch):
        data = self.queue.fields.clone()
        self.seen_response_masks.append(data["response_mask"].to_padded_tensor(0, output_size=(ROWS, TOKENS)))
        mini_batch_size = batch.extra_info["mini_batch_size"]
        config = actor_config("vanilla", micro_batch_size=1)
        for step in verl_split(data, DP_SIZE, mini_batch_size):
            batch_num_tokens = sum(int(mini_batch["loss_mask"].sum()) for mini_batch in step)
            step_loss = 0
            for mini_batch in step:
                tu.assign_non_tensor(
                    mini_batch,
                    dp_size=DP_SIZE,
                    batch_num_tokens=batch_num_tokens,
                    global_batch_size=batch.extra_info["global_batch_size"],
                    use_dynamic_bsz=False,
                    micro_batch_size_per_gpu=1,
                )
                micro_batches, _ = prepare_micro_batches(mini_batch, dp_group=None, same_micro_num_in_dp=True)
                for micro_batch in micro_batches:
                    rows = micro_batch["row"]
                    output = model_output(micro_batch, self.leaf[rows], self.entropies[rows])
                    loss, _ = ppo_loss(config, output, micro_batch)
                    (loss / DP_SIZE).backward()
                    step_loss = step_loss + loss.detach() / DP_SIZE
            self.step_losses.append(step_loss)
        return {"metrics": {"mfu": [0.0]}}


@pytest.fixture
def pool_config():
    config_dir = str(verl.__path__[0]) + "/trainer/config"
    overrides = [
        "trainer.v1.trainer_mode=stapo_sync",
        f"data.train_batch_size={ROWS // ROLLOUT_N}",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor._target_=stapo_trl.verl.actor_config.CheckedFSDPActorConfig",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_the_pool_trainer_trains_on_trl_s_whole_step_mask_and_dapo_loss(tmp_path, monkeypatch, pool_config):
    log_probs, entropies = old_statistics()
    keys = [f"uid{row // ROLLOUT_N}_{row % ROLLOUT_N}_0" for row in range(ROWS)]
    fields = actor_mini_batch(log_probs, ADVANTAGES, RESPONSE_MASK, layout="v1", extra={"entropy": entropies})
    original_masks = {name: fields[name].clone() for name in ("response_mask", "loss_mask")}
    queue = FakeTransferQueue(keys, fields)
    monkeypatch.setattr(pool_trainer, "tq", queue)
    trainer = S2TPoolTrainer.__new__(S2TPoolTrainer)
    trainer.config = pool_config
    trainer.keep_rule = KEEP_RULE
    leaf = log_probs.clone().requires_grad_(True)
    trainer.actor_rollout_wg = ActorWorkers(queue, leaf, entropies)
    metrics = {}

    trainer._update_actor(KVBatchMeta(keys=keys, tags=[{}] * ROWS, partition_id="train"), metrics)

    trl_leaf = log_probs.clone().requires_grad_(True)
    (seen,) = trainer.actor_rollout_wg.seen_response_masks
    silenced_counts = []
    for step, rows in enumerate(STEP_ROWS):
        trl_silenced, trl_loss = trl_step(tmp_path, log_probs, entropies, rows, leaf=trl_leaf)
        assert torch.equal(RESPONSE_MASK[rows].bool() & ~seen[rows].bool(), trl_silenced)
        kept = RESPONSE_MASK[rows].bool() & ~trl_silenced
        by_hand = -(ADVANTAGES[rows, None].expand(-1, TOKENS)[kept]).sum() / kept.sum()
        torch.testing.assert_close(trl_loss.detach(), by_hand, **TOLERANCE)
        torch.testing.assert_close(trainer.actor_rollout_wg.step_losses[step], by_hand, **TOLERANCE)
        trl_loss.backward()
        silenced_counts.append(int(trl_silenced.sum()))
    torch.testing.assert_close(leaf.grad, trl_leaf.grad, **TOLERANCE)
    assert all(count > 0 for count in silenced_counts)
    assert metrics["actor/s2t/num_silenced"] == pytest.approx(sum(silenced_counts) / len(silenced_counts))
    for name, mask in original_masks.items():
        assert torch.equal(queue.fields[name].values(), mask.values()), f"{name} was not restored"
    assert [sorted(put.keys()) for put in queue.puts] == [["loss_mask", "response_mask"]] * 2


def test_verl_finds_the_trainer_mode_through_its_entry_point():
    assert get_trainer_cls("stapo_sync") is S2TPoolTrainer


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.actor.policy_loss.loss_mode=stapo", r"loss_mode=stapo masks each micro-batch again"),
        ("actor_rollout_ref.actor.shuffle=True", r"shuffle=True .* set it to False"),
        ("algorithm.rollout_correction.bypass_mode=True", r"bypass_mode=True .* computes no entropy"),
    ],
)
def test_the_trainer_mode_refuses_settings_it_cannot_pool_before_any_rollout(pool_config, override, message):
    key, value = override.split("=")
    node = pool_config
    *path, leaf_key = key.split(".")
    for part in path:
        node = node[part]
    node[leaf_key] = {"True": True}.get(value, value)
    with pytest.raises(ValueError, match=message):
        S2TPoolTrainer(pool_config)


def test_the_recipe_s_settings_pass_the_check(pool_config):
    check_pool_settings(pool_config)


def test_the_metrics_are_the_mean_over_steps_and_leave_out_an_undefined_threshold():
    steps = [{"num_silenced": 3, "entropy_threshold": 0.5}, {"num_silenced": 0, "entropy_threshold": math.nan}]
    assert mean_over_steps(steps) == {"actor/s2t/num_silenced": 1.5, "actor/s2t/entropy_threshold": 0.5}


def test_a_registered_pool_trainer_carries_its_thresholds(monkeypatch):
    monkeypatch.delitem(TRAINER_REGISTRY, "stapo_sync_test", raising=False)
    monkeypatch.setattr(pool_trainer, "POOL_TRAINER_MODES", set(pool_trainer.POOL_TRAINER_MODES))
    trainer = pool_trainer.register_s2t_pool_trainer("stapo_sync_test", prob_threshold=0.05, entropy_quantile=0.5)
    assert "stapo_sync_test" in pool_trainer.POOL_TRAINER_MODES
    assert get_trainer_cls("stapo_sync_test") is trainer and issubclass(trainer, S2TPoolTrainer)
    assert trainer.keep_rule.keywords == THRESHOLDS
    assert S2TPoolTrainer.keep_rule.keywords == {"prob_threshold": 0.002, "entropy_quantile": 0.8}
    monkeypatch.delitem(TRAINER_REGISTRY, "stapo_sync_test")
    with pytest.raises(ValueError, match="entropy_quantile must be in"):
        pool_trainer.register_s2t_pool_trainer("stapo_sync_test", entropy_quantile=80)
