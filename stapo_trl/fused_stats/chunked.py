"""Our chunked torch backend: per-token log p and entropy of ``hidden @ weight.T`` without ``[N, V]`` logits.

Each chunk of tokens is projected, turned into log-probabilities and probabilities in two reused buffers, reduced to
the sampled token's log-probability and the entropy, and dropped. The backward recomputes the chunk instead of
storing it, so peak memory is two ``[chunk_size, V]`` buffers whatever N is.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 512


def _project(hidden_chunk, weight, bias, inverse_temperature, out):
    torch.mm(hidden_chunk, weight.t(), out=out)
    if bias is not None:
        out.add_(bias)
    return out.mul_(inverse_temperature)


def _dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product without allocating an ``a * b`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class ChunkedLogProbEntropy(torch.autograd.Function):
    """``(log_probs [N], entropies [N])`` of ``softmax((hidden @ weight.T + bias) / temperature)`` at ``targets``.

    Computes in ``promote_types(hidden.dtype, float32)``: bf16 inputs are projected in fp32 (one fp32 copy of the
    weight), fp64 inputs stay fp64, which is what the gradient checks use.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        ctx.set_materialize_grads(False)
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        num_tokens = hidden.shape[0]
        inverse_temperature = 1.0 / temperature

        log_probs = hidden.new_empty(num_tokens, dtype=compute_dtype)
        entropies = torch.empty_like(log_probs)
        log_partition = torch.empty_like(log_probs)
        rows = min(chunk_size, max(num_tokens, 1))
        logits_buffer = hidden.new_empty((rows, weight.shape[0]), dtype=compute_dtype)
        probs_buffer = torch.empty_like(logits_buffer)

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _project(
                hidden[start:end].to(compute_dtype),
                weight_c,
                bias_c,
                inverse_temperature,
                logits_buffer[: end - start],
            )
            row_max = logits.amax(dim=-1, keepdim=True)
            log_softmax = logits.sub_(row_max)
            probs = torch.exp(log_softmax, out=probs_buffer[: end - start])
            normalizer = probs.sum(dim=-1, keepdim=True)
            log_softmax.sub_(normalizer.log())
            probs.div_(normalizer)
            log_probs[start:end] = log_softmax.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
            entropies[start:end] = -_dot_rows(probs, log_softmax)
            log_partition[start:end] = (row_max + normalizer.log()).squeeze(-1)

        ctx.save_for_backward(hidden, weight, bias, targets, log_partition, entropies)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return log_probs, entropies

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropies):
        hidden, weight, bias, targets, log_partition, entropies = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropies is None:
            return None, None, None, None, None, None
        compute_dtype = log_partition.dtype
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        inverse_temperature = 1.0 / ctx.temperature
        num_tokens, chunk_size = hidden.shape[0], ctx.chunk_size

        grad_hidden = torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=compute_dtype, device=bias.device) if needs_bias else None
        rows = min(chunk_size, max(num_tokens, 1))
        logits_buffer = hidden.new_empty((rows, weight.shape[0]), dtype=compute_dtype)
        probs_buffer = torch.empty_like(logits_buffer)

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            hidden_chunk = hidden[start:end].to(compute_dtype)
            log_softmax = _project(hidden_chunk, weight_c, bias_c, inverse_temperature, logits_buffer[: end - start])
            log_softmax.sub_(log_partition[start:end].unsqueeze(-1))
            probs = torch.exp(log_softmax, out=probs_buffer[: end - start])

            # d H / dz_j = -p_j (log p_j + H);  d log p_y / dz_j = 1[j = y] - p_j;  z = logits / temperature
            grad_logits = log_softmax
            if grad_entropies is not None:
                grad_logits.add_(entropies[start:end].unsqueeze(-1)).mul_(probs)
                grad_logits.mul_(-grad_entropies[start:end].to(compute_dtype).unsqueeze(-1))
            else:
                grad_logits.zero_()
            if grad_log_probs is not None:
                chunk_grad = grad_log_probs[start:end].to(compute_dtype).unsqueeze(-1)
                grad_logits.sub_(probs.mul_(chunk_grad))
                grad_logits.scatter_add_(-1, targets[start:end].unsqueeze(-1), chunk_grad)
            grad_logits.mul_(inverse_temperature)

            if grad_hidden is not None:
                torch.mm(grad_logits, weight_c, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), hidden_chunk)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(dim=0))

        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log_probs [N], entropies [N])`` for ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]``."""
    return ChunkedLogProbEntropy.apply(hidden, weight, bias, targets, temperature, chunk_size)
