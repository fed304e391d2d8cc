"""Per-token log-probability and entropy of an LM head at close to the cost of its GEMMs: the ``torch`` statistics
backend, and the op of stapo-trl's CPU LM head (:mod:`stapo_trl.cpu.lm_head`).

For ``N`` tokens and ``V`` entries, ``z = transform(hidden @ weight.T + bias)`` (TRL's transform: ``logit_scale``, an
optional ``softcap * tanh(. / softcap)``, then ``/ temperature``); it returns ``log softmax(z)[target]`` and the
entropy of ``softmax(z)``. The forward projects ``block_rows`` tokens per GEMM and streams the softmax and the
entropy's ``sum(p * z)`` through reused ``[SLAB_ROWS, V]`` buffers; the backward forms the logits' gradient in place
and needs the weight's GEMM only when the weight requires grad. When the transformed logits of all ``N`` tokens fit in
``keep_logits_bytes`` the backward reuses them (two GEMMs in all instead of three); otherwise it recomputes them block
by block and memory stays at one ``[block_rows, V]`` and two ``[SLAB_ROWS, V]`` buffers whatever ``N`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_ROWS = 1024
DEFAULT_KEEP_LOGITS_BYTES = 1 << 30
SLAB_ROWS = 128
"""Rows per pass of the elementwise work: a ``[128, V]`` buffer is a few tens of MB."""


def _dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of two ``[n, V]`` tensors without an ``a * b`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _slabs(start: int, end: int):
    for slab_start in range(start, end, SLAB_ROWS):
        yield slab_start, min(slab_start + SLAB_ROWS, end)


@dataclass
class _Transform:
    """TRL's logit transform, applied in place, and its derivative."""

    inverse_temperature: float
    softcap: float | None
    logit_scale: float

    def project(self, hidden_block, weight, bias, out):
        """``out = transform(hidden_block @ weight.T + bias)``."""
        torch.mm(hidden_block, weight.t(), out=out)
        if bias is not None:
            out.add_(bias)
        if self.softcap is None:
            scale = self.logit_scale * self.inverse_temperature
            if scale != 1.0:
                out.mul_(scale)
            return out
        if self.logit_scale != 1.0:
            out.mul_(self.logit_scale)
        out.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.inverse_temperature != 1.0:
            out.mul_(self.inverse_temperature)
        return out

    def softcap_derivative(self, z, out):
        """``1 - tanh^2``, the softcap's factor of ``dz / d(projection)``, from the transformed logits ``z``."""
        torch.mul(z, 1.0 / (self.softcap * self.inverse_temperature), out=out)
        return out.square_().neg_().add_(1.0)


class CPULogProbEntropy(torch.autograd.Function):
    """``(log_probs [N], entropies [N] or an empty tensor)`` of the transformed logits ``z`` at ``targets``.

    Computes in ``hidden.dtype`` (fp32, or fp64 for gradient checks); ``weight`` and ``bias`` must share it.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        inverse_temperature,
        softcap,
        logit_scale,
        want_entropy,
        block_rows,
        keep_logits_bytes,
    ):
        ctx.set_materialize_grads(False)
        transform = _Transform(inverse_temperature, softcap, logit_scale)
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        records_graph = any(ctx.needs_input_grad[:3])
        keep = records_graph and num_tokens * vocab * hidden.element_size() <= keep_logits_bytes
        rows = max(1, num_tokens if keep else min(block_rows, num_tokens))

        log_probs = hidden.new_empty(num_tokens)
        log_partition = hidden.new_empty(num_tokens)
        entropies = hidden.new_empty(num_tokens if want_entropy else 0)
        projection = hidden.new_empty((rows, vocab))
        exp_buffer = hidden.new_empty((min(SLAB_ROWS, rows), vocab))

        for start in range(0, num_tokens, rows):
            end = min(start + rows, num_tokens)
            block = transform.project(hidden[start:end], weight, bias, projection[: end - start])
            for slab_start, slab_end in _slabs(start, end):
                z = block[slab_start - start : slab_end - start]
                row_max = z.amax(dim=-1, keepdim=True)
                exp = torch.sub(z, row_max, out=exp_buffer[: slab_end - slab_start]).exp_()
                sum_exp = exp.sum(dim=-1, keepdim=True)
                slab_log_partition = row_max.add_(sum_exp.log()).squeeze(-1)
                log_partition[slab_start:slab_end] = slab_log_partition
                target_logits = z.gather(-1, targets[slab_start:slab_end].unsqueeze(-1)).squeeze(-1)
                log_probs[slab_start:slab_end] = target_logits - slab_log_partition
                if want_entropy:
                    entropies[slab_start:slab_end] = slab_log_partition - _dot_rows(exp, z) / sum_exp.squeeze(-1)

        ctx.save_for_backward(hidden, weight, bias, targets, log_partition, entropies)
        ctx.transform = transform
        ctx.block_rows = block_rows
        ctx.kept = projection if keep else None
        if not want_entropy:
            ctx.mark_non_differentiable(entropies)
        return log_probs, entropies

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropies):
        hidden, weight, bias, targets, log_partition, entropies = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        nothing = (None,) * 10
        if grad_entropies is not None and grad_entropies.numel() == 0:
            grad_entropies = None
        if grad_log_probs is None and grad_entropies is None:
            return nothing
        transform = ctx.transform
        kept, ctx.kept = ctx.kept, None
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        rows = max(1, num_tokens if kept is not None else min(ctx.block_rows, num_tokens))

        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if needs_bias else None
        projection = kept if kept is not None else hidden.new_empty((rows, vocab))
        slab = min(SLAB_ROWS, rows)
        # dz / d(projection) without the softcap's factor
        scale = transform.inverse_temperature * transform.logit_scale
        probs_buffer = hidden.new_empty((slab, vocab)) if grad_entropies is not None else None
        softcap_buffer = hidden.new_empty((slab, vocab)) if transform.softcap is not None else None

        def logit_gradient_(z: torch.Tensor, tokens: slice) -> torch.Tensor:
            """Overwrite the transformed logits ``z`` of the ``tokens`` with the loss's gradient with respect to
            the projection. ``d log p_y / dz = onehot(y) - p`` and ``d H / dz = -p (log p + H)``. With ``a = g_logp *
            s`` and ``b = g_H * s``, where ``s`` is the transform's scale, the gradient is ``onehot(y) a - p (b (log p
            + H) + a)``, times the softcap's factor when there is one."""
            count = tokens.stop - tokens.start
            softcap_factor = (
                None if softcap_buffer is None else transform.softcap_derivative(z, softcap_buffer[:count])
            )
            slab_log_partition = log_partition[tokens].unsqueeze(-1)
            target_weight = None if grad_log_probs is None else grad_log_probs[tokens].unsqueeze(-1) * scale
            if grad_entropies is not None:
                probs = torch.sub(z, slab_log_partition, out=probs_buffer[:count]).exp_()
                grad = z.sub_(slab_log_partition - entropies[tokens].unsqueeze(-1))
                grad.mul_(grad_entropies[tokens].unsqueeze(-1) * -scale)
                if target_weight is not None:
                    grad.sub_(target_weight)
                grad.mul_(probs)
            else:
                grad = z.sub_(slab_log_partition).exp_().mul_(-target_weight)
            if target_weight is not None:
                grad.scatter_add_(-1, targets[tokens].unsqueeze(-1), target_weight)
            if softcap_factor is not None:
                grad.mul_(softcap_factor)
            return grad

        for start in range(0, num_tokens, rows):
            end = min(start + rows, num_tokens)
            block = projection[: end - start]
            if kept is None:
                transform.project(hidden[start:end], weight, bias, block)
            for slab_start, slab_end in _slabs(start, end):
                logit_gradient_(block[slab_start - start : slab_end - start], slice(slab_start, slab_end))
            if grad_hidden is not None:
                torch.mm(block, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(block.t(), hidden[start:end])
            if grad_bias is not None:
                grad_bias.add_(block.sum(dim=0))

        return (grad_hidden, grad_weight, grad_bias, *nothing[3:])


def cpu_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    want_entropy: bool = True,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable ``(log_probs [N], entropies [N] or None)`` for ``hidden [N, H]``, ``weight [V, H]``, ``targets
    [N]``, with TRL's fused-head transform (``logit_scale``, ``softcap``, ``temperature``)."""
    log_probs, entropies = CPULogProbEntropy.apply(
        hidden,
        weight,
        bias,
        targets,
        1.0 / temperature,
        softcap,
        logit_scale,
        want_entropy,
        block_rows,
        keep_logits_bytes,
    )
    return log_probs, entropies if want_entropy else None


def blocked_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log_probs [N], entropies [N])`` for ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]``.

    Computes in ``promote_types(hidden.dtype, float32)``: bf16 or fp16 inputs are cast to fp32 first (the weight
    too, one fp32 copy of it), and the gradients flow back through those casts.
    """
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    return cpu_logprob_entropy(
        hidden.to(compute_dtype),
        weight.to(compute_dtype),
        targets,
        bias=None if bias is None else bias.to(compute_dtype),
        temperature=temperature,
        block_rows=block_rows,
        keep_logits_bytes=0,
    )
