"""What the verl plugin relies on in verl 0.9.1, each checked against the installed verl by running it.

The plugin patches nothing. It relies on four details of verl that are not a documented API; each check below runs
verl's own code on a tiny batch and lists what no longer fits. ``python -m stapo_trl.verl.drift`` prints them, and
``tests/verl_plugin/test_drift.py`` runs them: a verl upgrade that moves one fails there by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn, register_policy_loss
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from ..token_rules import per_token_advantages
from .actor_batch import actor_micro_batches, actor_mini_batch, model_output
from .entropy import entropy_from_ppo_loss

TESTED_VERL = "0.9.1"
POLICY_LOSS_ARGUMENTS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)
PROBE_LOSS_MODE = "stapo_trl_drift_probe"


@dataclass(frozen=True)
class VerlDependency:
    name: str
    relies_on: str
    check: Callable[[], list[str]]


def probe_tensors() -> dict[str, torch.Tensor]:
    """Two responses of lengths 3 and 2, in float64."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return {
        "log_probs": -torch.rand(2, 3, generator=generator, dtype=torch.float64) * mask,
        "entropy": torch.rand(2, 3, generator=generator, dtype=torch.float64) * mask,
        "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
        "mask": mask,
    }


def _run_ppo_loss(loss_mode: str = PROBE_LOSS_MODE, probe=None):
    """verl's ``ppo_loss`` on `probe_tensors` with the policy loss ``loss_mode``, or ``probe`` registered for the
    call."""
    if probe is not None:
        register_policy_loss(PROBE_LOSS_MODE)(probe)
    try:
        tensors = probe_tensors()
        data = actor_mini_batch(tensors["log_probs"], tensors["advantages"], tensors["mask"])
        (micro_batch,) = actor_micro_batches(data, micro_batch_size=2)
        output = model_output(micro_batch.data, tensors["log_probs"], tensors["entropy"])
        policy_loss = PolicyLossConfig(loss_mode=loss_mode)
        config = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            loss_agg_mode="token-mean",
            policy_loss=policy_loss,
        )
        loss, metrics = ppo_loss(config, output, micro_batch.data)
        return tensors, loss, metrics
    finally:
        POLICY_LOSS_REGISTRY.pop(PROBE_LOSS_MODE, None)


def check_version() -> list[str]:
    installed = version("verl")
    return (
        [] if installed == TESTED_VERL else [f"verl {installed} is installed; the plugin is tested on {TESTED_VERL}"]
    )


def check_policy_loss_call() -> list[str]:
    """``ppo_loss`` calls the loss named by ``policy_loss.loss_mode`` with the seven arguments by keyword, and a loss
    registered after import is found."""
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


def check_entropy_local() -> list[str]:
    """While the policy loss runs, ``ppo_loss`` holds the model output's entropy, padded to ``[B, T]`` like
    ``log_prob``, in its local ``entropy``."""
    read: dict[str, torch.Tensor] = {}

    def probe(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        read["entropy"] = entropy_from_ppo_loss(log_prob.shape)
        read["log_prob"] = log_prob
        return log_prob.sum() * 0, {}

    try:
        tensors, _, _ = _run_ppo_loss(probe=probe)
    except Exception as error:  # noqa: BLE001
        return [f"the entropy could not be read from ppo_loss: {error!r}"]
    problems = []
    if not torch.equal(read["entropy"], tensors["entropy"] * tensors["mask"]):
        problems.append("ppo_loss's local 'entropy' is not the padded per-token entropy of the model output")
    if not torch.equal(read["log_prob"], tensors["log_probs"] * tensors["mask"]):
        problems.append("ppo_loss no longer passes the padded per-token log_prob of the model output")
    return problems


def check_vanilla_reads_global_batch_info() -> list[str]:
    """``vanilla`` aggregates with ``config.global_batch_info``, which ``ppo_loss`` sets from the engine's
    ``batch_num_tokens`` before the call: at ratio 1, token-mean is ``-sum(A) / batch_num_tokens``."""
    source = inspect.getsource(get_policy_loss_fn("vanilla"))
    if "config.global_batch_info" not in source:
        return ["verl's vanilla loss no longer aggregates with config.global_batch_info"]
    tensors, loss, _ = _run_ppo_loss("vanilla")
    mask = tensors["mask"].bool()
    expected = -(per_token_advantages(tensors["advantages"], mask)[mask]).sum() / mask.sum()
    if not torch.isclose(loss.double(), expected, atol=1e-12):
        return [f"vanilla token-mean at ratio 1 gave {float(loss)}, expected {float(expected)}"]
    return []


DEPENDENCIES = (
    VerlDependency("version", f"verl {TESTED_VERL}", check_version),
    VerlDependency(
        "policy-loss call",
        "ppo_loss calls the registered loss_mode with (old_log_prob, log_prob, advantages, response_mask, "
        "loss_agg_mode, config, rollout_is_weights)",
        check_policy_loss_call,
    ),
    VerlDependency(
        "entropy local",
        "ppo_loss holds the padded [B, T] entropy in its local 'entropy' while the policy loss runs",
        check_entropy_local,
    ),
    VerlDependency(
        "global batch info",
        "vanilla aggregates with config.global_batch_info (batch_num_tokens, global_batch_size, dp_size)",
        check_vanilla_reads_global_batch_info,
    ),
)


def main() -> int:
    failures = 0
    for dependency in DEPENDENCIES:
        problems = dependency.check()
        failures += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {dependency.name}: {dependency.relies_on}")
        for problem in problems:
            print(f"     - {problem}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
