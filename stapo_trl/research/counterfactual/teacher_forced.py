"""The policy read teacher-forced on fixed prompts (left-padded) and responses (right-padded): at each response token,
its log-probability, the next-token entropy at a sampling temperature and optionally the distribution (for a KL)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ...core.token_stats.statistics import side_effect_free_pass
from ...cpu.frozen_layer_replay import frozen_layers_replaced, recording_first_trainable_input

READOUT_ROWS = 8  # rows per forward pass of a readout (x 40 tokens x SmolLM2's 49,152-token vocabulary: ~64 MB)


@dataclass
class FrozenInputs:
    """The first trainable layer's inputs for each forward of one set of sequences, recorded at its first readout and
    replayed at the later ones (`frozen_layers_replaced`); None until then, and None per forward that cannot skip."""

    recorded: list[list[torch.Tensor] | None] | None = None


@dataclass
class ProbeSequences:
    """``input_ids`` and ``attention_mask`` ``[N, P + R]`` (prompts left-padded to ``P``, responses right-padded to
    ``R``), and ``response_mask`` ``[N, R]``: the response tokens that are read."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor


def probe_sequences(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> ProbeSequences:
    """Join token-id prompts and responses into `ProbeSequences` (every response needs at least one token)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"Need as many responses as prompts, and at least one: {len(prompts)} and {len(responses)}.")
    if any(len(response) == 0 for response in responses):
        raise ValueError("Every response needs at least one token to read.")
    prompt_length, response_length = max(map(len, prompts)), max(map(len, responses))
    rows, masks, response_masks = [], [], []
    for prompt, response in zip(prompts, responses, strict=True):
        left, right = prompt_length - len(prompt), response_length - len(response)
        rows.append([pad_token_id] * left + prompt + response + [pad_token_id] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        response_masks.append([1] * len(response) + [0] * right)
    return ProbeSequences(torch.tensor(rows), torch.tensor(masks), torch.tensor(response_masks, dtype=torch.bool))


@torch.no_grad()
def sample_responses(
    model,
    prompts: list[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    eos_token_id: int,
    pad_token_id: int,
) -> list[list[int]]:
    """One response per prompt sampled from ``model`` in eval mode (no dropout) at ``temperature``, top-p 1 and no
    top-k, each cut after its first EOS token. Seeded by ``seed``; the caller's random streams are left as they were."""
    length = max(map(len, prompts))
    input_ids = torch.tensor([[pad_token_id] * (length - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    device = next(model.parameters()).device
    with side_effect_free_pass(model):
        torch.manual_seed(seed)
        options = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
        options |= dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **options)
    rows = output[:, length:].tolist()
    return [row[: row.index(eos_token_id) + 1 if eos_token_id in row else len(row)] for row in rows]


@dataclass
class PolicyReadout:
    """At each read response token (``response_mask`` flattened, in row order): its log-probability, the next-token
    entropy (nats), and when asked for the log-distribution ``[tokens, V]``."""

    log_probs: torch.Tensor
    entropies: torch.Tensor
    log_distributions: torch.Tensor | None
    rows: torch.Tensor  # the row of each read token, for per-sequence sums
    kl_from: torch.Tensor | None = None  # KL(this policy || the reference), when `read_policy` was given a reference


@torch.no_grad()
def read_policy(
    model,
    sequences: ProbeSequences,
    *,
    temperature: float,
    keep_distributions: bool = False,
    reference: torch.Tensor | None = None,
    frozen: FrozenInputs | None = None,
) -> PolicyReadout:
    """Read ``model`` (in eval mode) on ``sequences``. ``reference``: another policy's log-distributions on the same
    sequences, for ``KL(model || reference)``; ``frozen``: see `FrozenInputs`."""
    device = next(model.parameters()).device
    keep = sequences.response_mask.size(1)
    log_probs, entropies, distributions, rows, kls, recorded = [], [], [], [], [], []
    offset = 0
    recording = frozen is not None and frozen.recorded is None
    with side_effect_free_pass(model):
        for index, start in enumerate(range(0, sequences.input_ids.size(0), READOUT_ROWS)):
            chunk = slice(start, start + READOUT_ROWS)
            input_ids = sequences.input_ids[chunk].to(device)
            attention_mask = sequences.attention_mask[chunk].to(device)
            position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
            if recording:
                context = recording_first_trainable_input(model)
            elif frozen is not None and frozen.recorded[index] is not None:
                context = frozen_layers_replaced(model, frozen.recorded[index])
            else:
                context = nullcontext()
            with context as inputs:
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=keep + 1,
                ).logits[:, :keep]
            if recording:
                recorded.append(inputs)
            log_distribution = torch.log_softmax(logits.float() / temperature, dim=-1)
            read = sequences.response_mask[chunk].to(device)
            chosen = log_distribution.gather(-1, input_ids[:, -keep:].unsqueeze(-1)).squeeze(-1)
            entropy = -(log_distribution.exp() * log_distribution).sum(-1)
            log_probs.append(chosen[read].cpu())
            entropies.append(entropy[read].cpu())
            rows.append(torch.arange(start, start + read.size(0)).unsqueeze(1).expand_as(read)[read.cpu()])
            if keep_distributions or reference is not None:
                read_distribution = log_distribution[read].cpu()
                if keep_distributions:
                    distributions.append(read_distribution)
                if reference is not None:
                    count = read_distribution.size(0)
                    kls.append(kl_divergence(read_distribution, reference[offset : offset + count]))
                    offset += count
    if recording:
        frozen.recorded = recorded
    return PolicyReadout(
        torch.cat(log_probs),
        torch.cat(entropies),
        torch.cat(distributions) if keep_distributions else None,
        torch.cat(rows),
        torch.cat(kls) if reference is not None else None,
    )


def kl_divergence(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``KL(new || old)`` per position, in nats, from log-distributions ``[tokens, V]``."""
    return (new.exp() * (new - old)).sum(-1).clamp(min=0)


def per_row_sums(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The sum of ``values`` over each row's read tokens (``[num_rows]``, float64)."""
    return torch.zeros(num_rows, dtype=torch.float64).index_add_(0, rows, values.double())
