"""Trainer mode ``stapo_sync`` is verl's sync trainer in every behaviour but the mask: built as verl builds it, from
the recipe's config, it takes the branch of verl's own ``sync`` mode at each place where verl's v1 trainer compares its
mode's name with ``"sync"`` (``verl/trainer/ppo/v1/trainer_base.py``): the replay buffer (line 153), the dataloader's
generation batch size (731), what a checkpoint saves (1004) and restores (902, 912), and what is stored in
TransferQueue with the prompts (1499). Each with and without DAPO's group filtering (``algorithm.filter_groups``).

verl's code runs here for each of those methods, the trainers' constructors included. Not run: the actor and rollout
workers (Ray worker groups, the FSDP engine, the agent loop), replaced by objects that record what the driver asks of
them; TransferQueue's store, whose calls are recorded instead (``tq.init`` is not called); and the data set, a list
of prompts in place of ``create_rl_dataset``'s parquet reading and tokenization.
"""

import os

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from test_verl_recipe import POOL_ARGUMENTS, recipe_config  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402

from stapo_trl.verl.pool_trainer import S2TPoolTrainer  # noqa: E402

SYNC_ARGUMENTS = [argument.replace("stapo_sync", "sync") for argument in POOL_ARGUMENTS]
FILTER_GROUPS = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]
PROMPTS = 600


class Recorder:
    """Stands in for a worker group, the agent loop or TransferQueue: records each call's name and keyword names."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, sorted(kwargs)))
            if name == "save_checkpoint" and args:
                os.makedirs(args[0], exist_ok=True)

        return record


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "filter_groups"])
def built(request, tmp_path_factory):
    """verl's sync trainer and the pool trainer, each built from the recipe's config by its own mode, as verl's task
    runner builds it (``trainer_cls(config=config)``), with its dataloader initialized."""
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_base, "create_rl_dataset", lambda *args, **kwargs: [{"uid": i} for i in range(PROMPTS)])
        for name, cls, arguments in (
            ("sync", PPOTrainerSync, SYNC_ARGUMENTS),
            ("stapo_sync", S2TPoolTrainer, POOL_ARGUMENTS),
        ):
            extra = FILTER_GROUPS if request.param else []
            config = recipe_config(*arguments, *extra, f"trainer.default_local_dir={root / name}")
            trainer = cls(config=config)
            trainer.tokenizer = trainer.processor = None
            trainer._init_dataloader()
            built[name] = trainer
    return built


@pytest.fixture
def trainers(built):
    """The built trainers, with fresh recorders for the workers and the agent loop."""
    for trainer in built.values():
        trainer.actor_rollout_wg = Recorder()
        trainer.agent_loop_manager = Recorder()
    return built


def test_each_is_built_by_its_own_mode_and_reads_sync(trainers):
    sync, pool = trainers["sync"], trainers["stapo_sync"]
    assert type(sync) is PPOTrainerSync and isinstance(pool, S2TPoolTrainer)
    assert sync.trainer_mode == pool.trainer_mode == "sync"
    assert pool.registered_mode == "stapo_sync"
    assert sync.parameter_sync_step == pool.parameter_sync_step


def test_the_replay_buffer_is_the_sync_one(trainers):
    sync, pool = (trainers[name].replay_buffer for name in ("sync", "stapo_sync"))
    assert type(pool) is type(sync) is trainer_base.ReplayBuffer

    def settings(buffer):
        return {key: value for key, value in vars(buffer).items() if isinstance(value, (bool, int, float, str))}

    assert settings(pool) == settings(sync)


def test_the_generation_batch_size_is_the_sync_one(trainers):
    sync, pool = trainers["sync"], trainers["stapo_sync"]
    assert pool.config.data.get("gen_batch_size") == sync.config.data.get("gen_batch_size")
    assert pool.train_dataloader.batch_size == sync.train_dataloader.batch_size
    filtering = sync.config.algorithm.filter_groups.enable
    # verl's sync trainer fetches a whole training batch at a time, one prompt at a time only with DAPO's filtering.
    assert sync.train_dataloader.batch_size == (1 if filtering else sync.config.data.train_batch_size)


def saved_checkpoint(trainer, monkeypatch):
    store = Recorder()
    monkeypatch.setattr(trainer_base, "tq", store)
    trainer.global_steps = 3
    trainer._save_checkpoint()
    root = trainer.config.trainer.default_local_dir
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    return files, trainer.actor_rollout_wg.calls, store.calls


def test_a_checkpoint_saves_what_the_sync_trainer_saves(trainers, monkeypatch):
    sync = saved_checkpoint(trainers["sync"], monkeypatch)
    pool = saved_checkpoint(trainers["stapo_sync"], monkeypatch)
    assert pool == sync
    files, _, transfer_queue_calls = pool
    assert files == ["global_step_3/data.pt", "latest_checkpointed_iteration.txt"]
    assert transfer_queue_calls == []  # no TransferQueue state: the sync trainer keeps none in flight


def test_resuming_restores_what_the_sync_trainer_restores(trainers, monkeypatch):
    restored = {}
    for name, trainer in trainers.items():
        saved_checkpoint(trainer, monkeypatch)
        store = Recorder()
        monkeypatch.setattr(trainer_base, "tq", store)
        folder = os.path.join(trainer.config.trainer.default_local_dir, "global_step_3")
        with open_dict(trainer.config):
            trainer.config.trainer.resume_mode = "resume_path"
            trainer.config.trainer.resume_from_path = folder
        trainer._load_checkpoint()
        reissued = trainer._reissue_inflight_prompts()
        restored[name] = (trainer.global_steps, trainer.actor_rollout_wg.calls[-1], store.calls, reissued)
    assert restored["stapo_sync"] == restored["sync"]
    assert restored["sync"][2:] == ([], 0)


def test_prompts_go_to_transfer_queue_as_the_sync_trainer_puts_them(trainers, monkeypatch):
    puts = {}
    for name, trainer in trainers.items():
        store = Recorder()
        monkeypatch.setattr(trainer_base, "tq", store)
        trainer.global_steps = 1
        batch = TensorDict({"input_ids": torch.ones(4, 3)}, batch_size=[4])
        batch.set_non_tensor("uid", [f"p{i}" for i in range(4)])
        assert trainer._submit_batch_to_rollout(batch) == 4
        puts[name] = store.calls
    assert puts["stapo_sync"] == puts["sync"] == [("kv_batch_put", ["keys", "partition_id", "tags"])]
