"""A verl 0.9.1 actor mini-batch and model output built from padded ``[B, T]`` tensors, without a model, as verl's
trainer and FSDP engine build them, so that verl's own ``ppo_loss`` can be called on known tensors.

The trainer hands the actor a left/right-padded batch that ``left_right_2_no_padding`` turns into verl's no-padding
layout; the engine adds ``dp_size``, ``batch_num_tokens`` and the trainer's ``global_batch_size``, splits it with
``prepare_micro_batches`` and calls the loss on each micro-batch with a model output whose ``log_probs`` and
``entropy`` are nested tensors over each whole sequence, shifted by one (the value at a position scores the next
token). :func:`actor_micro_batches` reproduces those steps with verl's own functions; only the model is left out.
The drift check and the tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding

from ..token_rules import per_token_advantages

PAD_TOKEN = 0
PROMPT_LENGTH = 2


@dataclass
class ActorMicroBatch:
    data: object
    """The micro-batch ``TensorDict``, as the engine passes it to the loss."""
    rows: torch.Tensor
    """The rows of the padded inputs that it holds, in order."""


def actor_mini_batch(
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    dp_size: int = 1,
    global_batch_size: int | None = None,
    batch_num_tokens: int | None = None,
):
    """One rank's mini-batch in verl's no-padding layout, with the engine's global batch information.

    ``response_mask`` marks each response's tokens (right padding after them). ``advantages`` is ``[B]`` or
    ``[B, T]``. ``batch_num_tokens`` defaults to this mini-batch's response tokens, as the engine's all-reduce gives
    on one rank; pass the sum over ranks otherwise.
    """
    rows, width = response_mask.shape
    prompts = torch.arange(3, 3 + PROMPT_LENGTH).repeat(rows, 1)
    prompt_attention = torch.ones(rows, PROMPT_LENGTH, dtype=torch.long)
    response_mask = response_mask.to(torch.long)
    responses = torch.where(response_mask.bool(), torch.arange(10, 10 + width).expand(rows, width), PAD_TOKEN)
    attention_mask = torch.cat([prompt_attention, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    advantages = per_token_advantages(advantages, response_mask)
    data = tu.get_tensordict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages * response_mask,
            "row": torch.arange(rows),
        }
    )
    data = left_right_2_no_padding(data)
    tokens = int(response_mask.sum()) if batch_num_tokens is None else batch_num_tokens
    tu.assign_non_tensor(
        data,
        dp_size=dp_size,
        batch_num_tokens=tokens,
        global_batch_size=rows * dp_size if global_batch_size is None else global_batch_size,
        use_dynamic_bsz=False,
    )
    return data


def actor_micro_batches(data, micro_batch_size: int) -> list[ActorMicroBatch]:
    """The engine's split of a mini-batch into micro-batches (``prepare_micro_batches``, fixed size)."""
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro_batch_size)
    micro_batches, _ = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)
    return [ActorMicroBatch(micro_batch, micro_batch["row"]) for micro_batch in micro_batches]


def model_output(micro_batch, log_probs: torch.Tensor, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
    """The engine's model output for ``micro_batch``: ``log_probs`` and ``entropy`` of its rows, given padded
    ``[B, T]`` over the response, laid out as nested tensors over each whole sequence, shifted by one.

    Positions outside the response hold 0; autograd flows from the nested values back to ``log_probs``.
    """
    attention = micro_batch["attention_mask"]
    prompt_width = micro_batch["prompts"].shape[1]
    prompt_lengths = attention[:, :prompt_width].sum(dim=1).tolist()
    response_lengths = attention[:, prompt_width:].sum(dim=1).tolist()

    def nested(values: torch.Tensor) -> torch.Tensor:
        pieces = []
        for row, (prompt_length, response_length) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
            pieces += [
                values.new_zeros(prompt_length - 1),
                values[row, :response_length],
                values.new_zeros(1),
            ]
        lengths = torch.tensor([p + r for p, r in zip(prompt_lengths, response_lengths, strict=True)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)

    return {"log_probs": nested(log_probs), "entropy": nested(entropy)}
