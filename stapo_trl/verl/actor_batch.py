"""A verl 0.9.1 actor mini-batch, its micro-batches and a model output, built from padded ``[B, T]`` tensors with
verl's own functions, so that verl's ``ppo_loss`` can be called on known tensors, in the layout of either trainer:
``"v0"`` (``trainer.use_v1=False``, padded prompts and responses) or ``"v1"`` (nested; docs/verl.md)."""

from __future__ import annotations

import torch
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding, response_to_nested

from ..core.token_rules import per_token_advantages

PAD_TOKEN = 0
PROMPT_LENGTH = 2
LAYOUTS = ("v0", "v1")


def _padded_batch(advantages: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, width = response_mask.shape
    prompts = torch.arange(3, 3 + PROMPT_LENGTH).repeat(rows, 1)
    response_mask = response_mask.to(torch.long)
    responses = torch.where(response_mask.bool(), torch.arange(10, 10 + width).expand(rows, width), PAD_TOKEN)
    attention_mask = torch.cat([torch.ones(rows, PROMPT_LENGTH, dtype=torch.long), response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": per_token_advantages(advantages, response_mask) * response_mask,
        "row": torch.arange(rows),
    }


def _v1_batch(old_log_probs, advantages, response_mask, extra):
    """Each sample's fields as verl's v1 agent loop stores them (prompts of 2 and 3 tokens on alternate rows, each
    response up to its last loss token), packed as TransferQueue's default storage returns a batch."""
    lengths = (response_mask.bool() * torch.arange(1, response_mask.shape[1] + 1)).amax(dim=1).clamp(min=1).tolist()
    samples = []
    for row, length in enumerate(lengths):
        prompt_length = PROMPT_LENGTH + row % 2
        prompts, responses = torch.arange(3, 3 + prompt_length), torch.arange(10, 10 + length)
        mask = response_mask[row, :length].to(torch.long)
        samples.append(
            {
                "prompts": prompts,
                "responses": responses,
                "response_mask": mask,
                "loss_mask": mask,
                "input_ids": torch.cat([prompts, responses]),
                "position_ids": torch.arange(prompt_length + length),
                "row": torch.tensor(row),
            }
        )
    fields = {name: [sample[name] for sample in samples] for name in samples[0]}
    nested_mask = torch.nested.as_nested_tensor(fields["response_mask"], layout=torch.jagged)
    driver_fields = {"old_log_probs": old_log_probs, "advantages": per_token_advantages(advantages, response_mask)}
    driver_fields.update(extra)
    for name, padded in driver_fields.items():
        fields[name] = list(response_to_nested(padded * response_mask.to(padded.dtype), nested_mask).unbind())
    packed = {name: AsyncSimpleStorageManager._pack_field_values(values) for name, values in fields.items()}
    return tu.get_tensordict(packed)


def actor_mini_batch(
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    layout: str = "v0",
    dp_size: int = 1,
    global_batch_size: int | None = None,
    batch_num_tokens: int | None = None,
    extra: dict[str, torch.Tensor] | None = None,
):
    """One rank's mini-batch in verl's ``layout`` (``"v0"`` or ``"v1"``), with the engine's global batch information:
    ``response_mask`` marks each response's loss tokens (right padding after them); ``advantages`` is ``[B]`` or
    ``[B, T]``. ``batch_num_tokens`` defaults to this mini-batch's ``loss_mask`` tokens (one rank). In the v1 layout,
    ``extra`` adds padded ``[B, T]`` fields that the driver writes per response (such as the old policy's ``entropy``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    rows = response_mask.shape[0]
    if layout == "v0":
        padded = {**_padded_batch(advantages, response_mask), "old_log_probs": old_log_probs}
        data = left_right_2_no_padding(tu.get_tensordict(padded))
    else:
        data = _v1_batch(old_log_probs, advantages, response_mask, extra or {})
    tokens = int(data["loss_mask"].sum()) if batch_num_tokens is None else batch_num_tokens
    global_batch_size = rows * dp_size if global_batch_size is None else global_batch_size
    tu.assign_non_tensor(
        data, dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=global_batch_size, use_dynamic_bsz=False
    )
    return data


def actor_micro_batches(data, micro_batch_size: int) -> list:
    """The engine's split of a mini-batch into micro-batch ``TensorDict``s as the engine passes them to the loss
    (``prepare_micro_batches``, fixed size); ``micro_batch["row"]`` are the rows of the padded inputs each holds."""
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro_batch_size)
    return prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)[0]


def sequence_lengths(micro_batch) -> tuple[list[int], list[int]]:
    """Each sequence's prompt and response lengths, read as ``no_padding_2_padding`` reads them in either layout."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    attention, prompt_width = micro_batch["attention_mask"], prompts.shape[1]
    return attention[:, :prompt_width].sum(dim=1).tolist(), attention[:, prompt_width:].sum(dim=1).tolist()


def model_output(micro_batch, log_probs: torch.Tensor, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
    """The engine's model output for ``micro_batch``: ``log_probs`` and ``entropy`` of its rows, given padded
    ``[B, T]`` over the response, as nested tensors over each whole sequence, shifted by one (0 outside the response;
    autograd flows back to ``log_probs``)."""
    prompt_lengths, lengths = sequence_lengths(micro_batch)

    def nested(values: torch.Tensor) -> torch.Tensor:
        rows = enumerate(zip(prompt_lengths, lengths, strict=True))
        pieces = [torch.cat([values.new_zeros(p - 1), values[row, :r], values.new_zeros(1)]) for row, (p, r) in rows]
        return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)

    return {"log_probs": nested(log_probs), "entropy": nested(entropy)}
