"""The per-token entropy that verl 0.9.1's ``ppo_loss`` computes but does not pass to the policy loss, read from its
local ``entropy`` (padded ``[B, T]`` like ``log_prob``) in the calling frame, changing nothing in verl (docs/verl.md,
"How the S2T loss gets the entropy"). verl computes it only with ``calculate_entropy`` or a nonzero entropy_coeff."""

from __future__ import annotations

import sys

import torch
from verl.workers.utils import losses as verl_losses


def entropy_from_ppo_loss(expected_shape: torch.Size) -> torch.Tensor:
    """The padded per-token entropy ``[B, T]`` of the micro-batch whose loss verl's ``ppo_loss`` is computing; a
    ValueError that says what to change when the caller is not ``ppo_loss``, verl computed no entropy, or its shape
    is not ``log_prob``'s."""
    code, frame = verl_losses.ppo_loss.__code__, sys._getframe()
    for _ in range(8):  # ppo_loss calls the policy loss, which calls this function
        if frame is None or (frame.f_code.co_name, frame.f_code.co_filename) == (code.co_name, code.co_filename):
            break
        frame = frame.f_back
    else:
        frame = None
    if frame is None:
        raise ValueError(
            "This policy loss reads the per-token entropy from verl's ppo_loss (verl.workers.utils.losses), and it "
            "was called from somewhere else. Select it with actor_rollout_ref.actor.policy_loss.loss_mode, or call "
            "stapo_trl.verl.losses.s2t_policy_loss with entropy= yourself."
        )
    entropy = frame.f_locals.get("entropy")
    if entropy is None:
        raise ValueError(
            "verl computed no per-token entropy for this micro-batch, and the S2T mask needs it: set "
            "actor_rollout_ref.actor.calculate_entropy=True (entropy_coeff stays 0, so the loss is unchanged)."
        )
    if entropy.shape != expected_shape:
        raise ValueError(
            f"verl's entropy has shape {tuple(entropy.shape)} and log_prob {tuple(expected_shape)}; they must match. "
            "The installed verl no longer pads its entropy as 0.9.1 does: run python -m stapo_trl.verl.drift."
        )
    return entropy
