"""Packed rows attend within their documents without a ``T x T`` mask (issue 46): the same
outputs and gradients as SDPA under the dense block-diagonal mask, and memory that grows
linearly with the row (the dense mask's grows with its square)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo.layers import Documents, document_mask


def _positions(lengths: list[list[int]]) -> torch.Tensor:
    """``(B, T)`` positions of rows of documents of ``lengths``."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])  # MHA, grouped-query
def test_documents_attend_as_the_dense_mask(heads: int, kv_heads: int) -> None:
    """Forward and backward (float64) equal SDPA's under :func:`document_mask`, the dense
    reference, for rows of several documents, one document and a 1-token one."""
    torch.manual_seed(0)
    positions = _positions([[5, 1, 7, 3], [16], [3, 13]])
    positions[2, :3] += 4  # a row that starts inside a document (its positions 4, 5, 6)
    B, T = positions.shape
    q = torch.randn(B, heads, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, T, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, T, 6, dtype=torch.float64, requires_grad=True)
    documents = Documents.of(positions)
    assert documents.spans[0] == [(0, 5), (5, 6), (6, 13), (13, 16)]
    got = documents.attend(q, k, v)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(positions), enable_gqa=heads != kv_heads
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    dense = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(grads, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _peak_bytes(T: int, dense: bool) -> int:
    """Peak live bytes of attention forward and backward over one row of 64-token documents
    (fp32, 4 heads of 32 channels), inputs excluded."""
    positions = _positions([[64] * (T // 64)])
    q, k, v = (torch.randn(1, 4, T, 32, requires_grad=True) for _ in range(3))
    with LiveTensorMemory() as memory:
        if dense:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
        else:
            out = Documents.of(positions).attend(q, k, v)
        out.sum().backward()
    return memory.peak_bytes


def test_memory_grows_linearly_with_the_row() -> None:
    """Doubling the row (2,048 -> 4,096 tokens, documents of 64) doubles the documents
    path's peak (within 10%; measured 2.00x); the dense mask's nearly quadruples (3.9x),
    to over 5x the documents path's at 4,096 (5.8x)."""
    documents = [_peak_bytes(T, dense=False) for T in (2048, 4096)]
    dense = [_peak_bytes(T, dense=True) for T in (2048, 4096)]
    assert documents[1] / documents[0] == pytest.approx(2.0, rel=0.1)
    assert dense[1] / dense[0] > 3.5
    assert dense[1] > 5 * documents[1]


def test_compiled_blocks_do_not_recompile_for_each_packing() -> None:
    """A compiled model (as ``compile: true`` compiles each block) over rows packed three
    different ways: the per-document attention runs outside the graphs, so they are
    compiled for the first packing only, and the logits equal eager's."""
    from plugintrain.model_zoo import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig.from_name("llama3-debug", vocab_size=64, n_layer=2, block_size=32)
    model = Transformer(config)
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = {key: torch.compile(block, backend=backend) for key, block in model.layers.items()}
    eager = dict(model.layers.items())
    for lengths in ([[5, 11, 16]], [[32]], [[3, 3, 20, 6]]):
        positions = _positions(lengths)
        tokens = torch.randint(0, 64, positions.shape)
        model.layers.update(compiled)
        got = model(tokens, positions=positions)
        if lengths == [[5, 11, 16]]:
            first = len(graphs)
        model.layers.update(eager)
        torch.testing.assert_close(got, model(tokens, positions=positions))
    assert first > 0 and len(graphs) == first


def test_compiled_recomputed_blocks_compile_once_with_the_same_gradients() -> None:
    """Recomputation around a compiled block (``activation_checkpointing`` with ``compile:
    true``): the block still compiles (the traced dense mask, no break inside the
    checkpoint), once for three packings, with eager's gradients."""
    from torch.utils.checkpoint import checkpoint

    from plugintrain.model_zoo import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig.from_name("llama3-debug", vocab_size=64, n_layer=1, block_size=32)
    model = Transformer(config).double()
    block = model.layers["0"]
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    def recomputed(h, rope, mask):
        return checkpoint(block, h, rope, None, mask, use_reentrant=False)

    compiled = torch.compile(recomputed, backend=backend)
    for lengths in ([[5, 11, 16]], [[32]], [[3, 3, 20, 6]]):
        positions = _positions(lengths)
        h = torch.randn(1, 32, config.n_embd, dtype=torch.float64, requires_grad=True)
        rope = (model.rope_cos[positions][:, None], model.rope_sin[positions][:, None])
        documents = Documents.of(positions)
        got = compiled(h, rope, documents)
        (grad,) = torch.autograd.grad(got.sum(), h)
        expected = block(h, rope, None, documents)
        (expected_grad,) = torch.autograd.grad(expected.sum(), h)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(grad, expected_grad)
    assert len(graphs) == 1


def test_causal_lm_hands_packed_attention_to_its_model() -> None:
    from plugintrain.model_zoo import CausalLM

    module = CausalLM(config="llama3-debug", packed_attention="dense")
    module.configure_model()
    assert module.model.packed_attention == "dense"
    with pytest.raises(ValueError, match=r"packed_attention='sparse': use documents"):
        CausalLM(config="llama3-debug", packed_attention="sparse")
