"""Context parallelism's pieces in one process (issue 46): the lower-right causal kernel
against SDPA under the dense mask it stands for, the chunks a rank holds, the document
pieces of a chunk, and the layouts refused before launch. The attention over real gloo
ranks is in ``tests/distributed/test_context_parallel_distributed.py``, the command line in
``tests/e2e/test_context_parallel_cli.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugintrain.core.context_shard import ContextShard
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.context_parallel import _chunk_pieces, lower_right_attention
from plugintrain.strategies import ParallelDims


def _reference(q, k, v):
    """SDPA under the dense lower-right causal mask, the math kernel."""
    Lq, Lk = q.size(2), k.size(2)
    mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    ("Lq", "Lk", "heads", "kv_heads", "hs", "hs_v"),
    [
        (5, 12, 4, 2, 16, 16),  # GQA, a chunk after a longer prefix
        (3, 20, 6, 3, 16, 16),
        (8, 8, 4, 4, 16, 16),  # no prefix: plain causal
        (6, 10, 4, 4, 24, 16),  # MLA: values narrower than queries
        (6, 10, 4, 4, 16, 24),  # and wider
    ],
)
def test_lower_right_attention_equals_the_dense_mask(Lq, Lk, heads, kv_heads, hs, hs_v) -> None:
    generator = torch.Generator().manual_seed(Lq * Lk)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q, k, v = draw(2, heads, Lq, hs), draw(2, kv_heads, Lk, hs), draw(2, kv_heads, Lk, hs_v)
    out = lower_right_attention(q, k, v)
    want = _reference(q, k, v)
    grad = torch.randn(want.shape, generator=generator, dtype=torch.float64)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def test_each_rank_holds_one_chunk_from_each_end() -> None:
    row = torch.arange(16)[None]
    held = [ContextShard(4, r).take(row)[0].tolist() for r in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(t for ranks in held for t in ranks) == list(range(16))
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel = 8"):
        ContextShard(4, 0).take(torch.arange(12)[None])


def test_chunk_pieces_cut_a_chunk_at_document_starts() -> None:
    # Documents at 0, 5 and 11; a chunk [4, 12) holds the end of the first, the whole
    # second and the start of the third, each seeing its own document's keys from its start.
    assert _chunk_pieces([0, 5, 11], 4, 12) == [(4, 5, 0), (5, 11, 5), (11, 12, 11)]
    assert _chunk_pieces([0, 5, 11], 12, 16) == [(12, 16, 11)]


def test_per_rank_attention_work_is_balanced() -> None:
    """The key-query pairs each rank's two chunks attend (lower-right causal): equal for
    every rank, so per-rank attention FLOPs agree (the issue asks within 5%)."""
    for cp in (2, 4, 8):
        T = 2 * cp * 64
        L = T // (2 * cp)
        work = [
            sum(L * c * L + L * (L + 1) // 2 for c in ContextShard(cp, r).chunks) for r in range(cp)
        ]
        assert max(work) / min(work) == 1.0
        # Contiguous chunks (rank r holding [rT/cp, (r+1)T/cp)) would not be: cp 2 is 1:3.
        contiguous = [(r * 2 * L) * 2 * L + 2 * L * (2 * L + 1) // 2 for r in range(cp)]
        assert max(contiguous) / min(contiguous) > 2


@pytest.mark.parametrize(
    ("dims", "seq_len", "message"),
    [
        (dict(context_parallel=2), 30, "seq_len=30 is not divisible by 2 x context_parallel=4"),
        (
            dict(context_parallel=2, tensor_parallel=2, sequence_parallel=True),
            36,  # 18 local tokens a rank, split over tp 2
            None,
        ),
        (
            dict(context_parallel=2, tensor_parallel=4, sequence_parallel=True),
            36,  # 18 local tokens do not split over tp 4
            "seq_len / context_parallel",
        ),
    ],
)
def test_layouts_are_checked_before_launch(dims, seq_len, message) -> None:
    layout = ParallelDims(world_size=dims.get("tensor_parallel", 1) * 2, **dims)
    config = TransformerConfig.from_name("llama3-debug", vocab_size=256)
    if message is None:
        layout.validate_model(config, seq_len)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        layout.validate_model(config, seq_len)


def test_dropout_is_refused_under_context_parallelism() -> None:
    layout = ParallelDims(world_size=2, context_parallel=2)
    config = TransformerConfig.from_name("gpt2-debug", dropout=0.1)
    with pytest.raises(ValueError, match="needs dropout 0"):
        layout.validate_model(config, 32)


def test_degrees_multiply_with_cp() -> None:
    assert ParallelDims(world_size=8, context_parallel=2, tensor_parallel=2).dp == 2
    with pytest.raises(ValueError, match="context_parallel=3"):
        ParallelDims(world_size=8, context_parallel=3)
