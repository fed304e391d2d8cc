"""The per-token entropy that verl 0.9.1's ``ppo_loss`` computes but does not pass to the policy loss: it holds it,
padded to ``[B, T]`` like ``log_prob``, in its local ``entropy``, which :func:`entropy_from_ppo_loss` reads from the
calling frame, changing nothing in verl (why not a patch: docs/verl.md, "How the S2T loss gets the entropy";
:mod:`stapo_trl.verl.drift` checks the local). verl computes it only with ``actor.calculate_entropy`` (or a nonzero
``entropy_coeff``).
"""

from __future__ import annotations

import sys

import torch
from verl.workers.utils import losses as verl_losses

PPO_LOSS_ENTROPY_LOCAL = "entropy"
"""The local of ``ppo_loss`` that holds the padded ``[B, T]`` entropy when it calls the policy loss."""

MISSING_ENTROPY_MESSAGE = (
    "verl computed no per-token entropy for this micro-batch, and the S2T mask needs it: set "
    "actor_rollout_ref.actor.calculate_entropy=True (entropy_coeff stays 0, so the loss is unchanged)."
)


def ppo_loss_frame(depth_limit: int = 8):
    """The frame of the ``ppo_loss`` call that is running, or None when the caller is not verl's ``ppo_loss``."""
    code = verl_losses.ppo_loss.__code__
    frame = sys._getframe(1)
    for _ in range(depth_limit):
        if frame is None:
            return None
        if frame.f_code.co_name == code.co_name and frame.f_code.co_filename == code.co_filename:
            return frame
        frame = frame.f_back
    return None


def entropy_from_ppo_loss(expected_shape: torch.Size) -> torch.Tensor:
    """The padded per-token entropy ``[B, T]`` of the micro-batch whose loss verl's ``ppo_loss`` is computing; a
    ValueError that says what to change when the caller is not ``ppo_loss``, verl computed no entropy, or its shape
    is not ``log_prob``'s."""
    frame = ppo_loss_frame()
    if frame is None:
        raise ValueError(
            "This policy loss reads the per-token entropy from verl's ppo_loss (verl.workers.utils.losses), and it "
            "was called from somewhere else. Select it with actor_rollout_ref.actor.policy_loss.loss_mode, or call "
            "stapo_trl.verl.losses.s2t_policy_loss with entropy= yourself."
        )
    entropy = frame.f_locals.get(PPO_LOSS_ENTROPY_LOCAL)
    if entropy is None:
        raise ValueError(MISSING_ENTROPY_MESSAGE)
    if entropy.shape != expected_shape:
        raise ValueError(
            f"verl's entropy has shape {tuple(entropy.shape)} and log_prob {tuple(expected_shape)}; they must match. "
            "The installed verl no longer pads its entropy as 0.9.1 does: run python -m stapo_trl.verl.drift."
        )
    return entropy
