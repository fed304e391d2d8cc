"""What the verl plugin relies on in verl 0.9.1, as `Seam`s of `stapo_trl.trl_boundary.drift_checks`: each runs verl's
own code on a tiny batch, or reads verl's source where the detail is on a GPU path. ``python -m stapo_trl.verl.drift``
prints them; ``tests/verl_plugin/test_drift.py`` runs them."""

from __future__ import annotations

import inspect
from importlib.metadata import version

import torch
from transfer_queue.metadata import BatchMeta
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.config import validate_config  # noqa: F401 - the checks read it here (tests replace it)
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from ..core.token_rules import per_token_advantages
from ..trl_boundary.drift_checks import Seam, contains, print_checks
from .actor_batch import LAYOUTS, actor_micro_batches, actor_mini_batch, model_output
from .losses import entropy_from_ppo_loss, stare_policy_loss
from .mini_batch_pool import optimizer_step_rows

TESTED_VERL = "0.9.1"
POLICY_LOSS_ARGUMENTS = tuple(
    name for name, p in inspect.signature(stare_policy_loss).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD
)
PROBE_LOSS_MODE = "stapo_trl_drift_probe"
HERE = __name__


def _run_ppo_loss(loss_mode: str = PROBE_LOSS_MODE, probe=None, layout: str = "v0"):
    """verl's ``ppo_loss`` on two float64 responses of lengths 3 and 2 in ``layout``, with the policy loss
    ``loss_mode`` or ``probe``; returns the tensors, the loss and the metrics."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tensors = {
        "log_probs": -torch.rand(2, 3, generator=generator, dtype=torch.float64) * mask,
        "entropy": torch.rand(2, 3, generator=generator, dtype=torch.float64) * mask,
        "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
        "mask": mask,
    }
    if probe is not None:
        register_policy_loss(PROBE_LOSS_MODE)(probe)
    try:
        data = actor_mini_batch(tensors["log_probs"], tensors["advantages"], tensors["mask"], layout=layout)
        (micro_batch,) = actor_micro_batches(data, micro_batch_size=2)
        output = model_output(micro_batch, tensors["log_probs"], tensors["entropy"])
        config = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            loss_agg_mode="token-mean",
            policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        )
        loss, metrics = ppo_loss(config, output, micro_batch)
        return tensors, loss, metrics
    finally:
        POLICY_LOSS_REGISTRY.pop(PROBE_LOSS_MODE, None)


def check_version() -> list[str]:
    if (installed := version("verl")) != TESTED_VERL:
        return [f"verl {installed} is installed; the plugin is tested on {TESTED_VERL}"]
    return []


def check_policy_loss_call() -> list[str]:
    seen: dict[str, object] = {}

    def probe(**arguments):
        seen.update(arguments)
        return arguments["log_prob"].sum() * 0, {}

    try:
        _run_ppo_loss(probe=probe)
    except Exception as error:  # noqa: BLE001 - any failure of verl's own code is the finding
        return [f"ppo_loss failed to call a registered policy loss by keyword: {error!r}"]
    if tuple(seen) != POLICY_LOSS_ARGUMENTS:
        return [f"ppo_loss passes {tuple(seen)} to the policy loss, not {POLICY_LOSS_ARGUMENTS}"]
    return []


def _entropy_local_problems(layout: str) -> list[str]:
    read: dict[str, torch.Tensor] = {}

    def probe(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        read["entropy"] = entropy_from_ppo_loss(log_prob.shape)
        read["log_prob"] = log_prob
        return log_prob.sum() * 0, {}

    try:
        tensors, _, _ = _run_ppo_loss(probe=probe, layout=layout)
    except Exception as error:  # noqa: BLE001
        return [f"{layout} layout: the entropy could not be read from ppo_loss: {error!r}"]
    problems = []
    if not torch.equal(read["entropy"], tensors["entropy"] * tensors["mask"]):
        problems.append(f"{layout} layout: ppo_loss's local 'entropy' is not the padded per-token entropy")
    if not torch.equal(read["log_prob"], tensors["log_probs"] * tensors["mask"]):
        problems.append(f"{layout} layout: ppo_loss no longer passes the padded per-token log_prob")
    return problems


def check_entropy_local() -> list[str]:
    return [problem for layout in LAYOUTS for problem in _entropy_local_problems(layout)]


def _vanilla_token_mean() -> list[str]:
    tensors, loss, _ = _run_ppo_loss("vanilla")
    mask = tensors["mask"].bool()
    expected = -(per_token_advantages(tensors["advantages"], mask)[mask]).sum() / mask.sum()
    if torch.isclose(loss.double(), expected, atol=1e-12):
        return []
    return [f"vanilla token-mean at ratio 1 gave {float(loss)}, expected {float(expected)}"]


def verl_optimizer_step_rows(batch_size: int, dp_size: int, mini_batch_size: int) -> list[torch.Tensor]:
    """Each optimizer step's rows, split by verl's own code: ``BatchMeta.chunk`` per rank, then ``make_iterator`` as
    ``TrainingWorker.train_mini_batch`` calls it (seed 42 plus the rank, ``actor.shuffle`` off)."""
    chunks = BatchMeta(global_indexes=list(range(batch_size)), partition_ids=["train"] * batch_size).chunk(dp_size)
    per_rank = []
    for rank, chunk in enumerate(chunks):
        rows = tu.get_tensordict({"row": torch.tensor(chunk.global_indexes)})
        mini_batches = tu.make_iterator(
            rows, mini_batch_size // dp_size, epochs=1, seed=42 + rank, dataloader_kwargs={"shuffle": False}
        )
        per_rank.append([mini_batch["row"] for mini_batch in mini_batches])
    return [torch.cat(step) for step in zip(*per_rank, strict=True)]


def _update_actor_arguments() -> list[str]:
    signature = inspect.signature(PPOTrainer._update_actor)
    changed = list(signature.parameters) != ["self", "batch", "metrics"]
    return [f"PPOTrainer._update_actor{signature} changed its arguments"] if changed else []


def _verl_splits_rows_as_the_pool_does() -> list[str]:
    return [
        f"verl splits 24 rows over {dp_size} ranks and steps of {mini_batch_size} otherwise"
        for dp_size, mini_batch_size in ((2, 4), (4, 8), (3, 6), (2, 24))
        if [rows.tolist() for rows in optimizer_step_rows(24, dp_size, mini_batch_size)]
        != [rows.tolist() for rows in verl_optimizer_step_rows(24, dp_size, mini_batch_size)]
    ]


POOL_TRAINER_HOOKS = Seam(
    "pool trainer hooks",
    "The driver's old log-probs (with entropy), advantages, then _update_actor: stapo_sync overrides the last.",
    contains(
        f"{HERE}:PPOTrainer._step_once",
        "self._compute_old_log_prob(",
        "self._compute_advantage(",
        "self._update_actor(",
        in_order=True,
    ),
    _update_actor_arguments,
    contains(f"{HERE}:PPOTrainer._compute_old_log_prob", '"calculate_entropy": True', 'data["entropy"]'),
    contains(f"{HERE}:PPOTrainer._update_actor", "self.actor_rollout_wg.update_actor(batch)"),
    contains("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch", 'data["loss_mask"].sum()'),
    contains(
        "verl.workers.engine_workers:TrainingWorker.train_mini_batch",
        "tu.make_iterator(",
        "seed + self.engine.get_data_parallel_rank()",
    ),
    _verl_splits_rows_as_the_pool_does,
)
ACTOR_CONFIG_AT_START_UP = Seam(
    "actor config at start-up",
    "validate_config and each worker's init_model build the actor config through _target_, running its checks.",
    contains(f"{HERE}:validate_config", "omega_conf_to_dataclass(config.actor_rollout_ref.actor)"),
    contains(
        "verl.workers.engine_workers:ActorRolloutRefWorker.init_model", "omega_conf_to_dataclass(self.config.actor)"
    ),
)
check_pool_trainer_hooks = POOL_TRAINER_HOOKS.check
check_actor_config_built_at_start_up = ACTOR_CONFIG_AT_START_UP.check

DEPENDENCIES = (
    Seam("version", f"verl {TESTED_VERL} is installed: every check below.", check_version),
    Seam(
        "policy-loss call",
        "ppo_loss calls the loss registered as loss_mode with POLICY_LOSS_ARGUMENTS, which the plugin's losses take.",
        check_policy_loss_call,
    ),
    Seam(
        "entropy local",
        "ppo_loss holds the padded [B, T] entropy in its local 'entropy' while the loss runs: S2T reads it there.",
        check_entropy_local,
    ),
    Seam(
        "global batch info",
        "vanilla aggregates with config.global_batch_info, through which the S2T loss counts only the kept tokens.",
        contains("verl.trainer.ppo.core_algos:compute_policy_loss_vanilla", "config.global_batch_info"),
        _vanilla_token_mean,
    ),
    POOL_TRAINER_HOOKS,
    ACTOR_CONFIG_AT_START_UP,
)


def main() -> int:
    return print_checks(DEPENDENCIES)


if __name__ == "__main__":
    raise SystemExit(main())
