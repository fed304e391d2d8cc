"""What ``calculate_entropy`` makes autograd keep from the forward to the backward pass, per logit, for verl's own
entropy functions: the figures that docs/verl.md ("What the entropy costs in memory") multiplies by the recipe's shapes.

Measured with ``torch.autograd.graph.saved_tensors_hooks`` on the CPU, counting the storage of every saved tensor
except the logits' own (the log-probability already keeps them). GPU autocast, which can change the dtypes, is not
covered.
"""

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402

TOKENS, VOCABULARY = 64, 1000


def kept_bytes_per_logit(entropy_of, dtype) -> float:
    logits = torch.randn(TOKENS, VOCABULARY, dtype=dtype, requires_grad=True)
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() != logits.untyped_storage().data_ptr():
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        entropy_of(logits)
    return sum(kept.values()) / logits.numel()


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_entropy_keeps_one_tensor_the_size_of_the_logits(dtype, size):
    """verl's ``entropy_from_logits`` keeps its softmax, ``[N, V]`` in the logits' dtype, plus ``[N]`` values."""
    assert kept_bytes_per_logit(verl_F.entropy_from_logits, dtype) == pytest.approx(size, abs=size / VOCABULARY * 1.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_checkpointing_keeps_nothing_beyond_the_logits(dtype):
    """``entropy_checkpointing=True`` wraps the same function in ``torch.utils.checkpoint`` (transformer_impl.py),
    which recomputes it in the backward pass."""

    def checkpointed(logits):
        return torch.utils.checkpoint.checkpoint(verl_F.entropy_from_logits, logits, use_reentrant=False)

    assert kept_bytes_per_logit(checkpointed, dtype) == 0


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 4), (torch.bfloat16, 8)])
def test_chunked_entropy_keeps_float32_copies(dtype, size):
    """``entropy_from_logits_with_chunking`` lowers the forward's peak, but under autograd every chunk's softmax, and
    for bfloat16 logits every chunk's float32 copy, stay until the backward: more than the plain function keeps."""
    kept = kept_bytes_per_logit(lambda logits: verl_F.entropy_from_logits_with_chunking(logits, 16), dtype)
    assert kept == pytest.approx(size, abs=size / VOCABULARY * 1.01)
