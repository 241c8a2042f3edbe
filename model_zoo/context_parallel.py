"""Context parallelism: every sequence split over the ``cp`` ranks, attention made whole by an
all-gather of keys and values.

**Which exchange, and why.** Each cp rank holds ``1/cp`` of every row's tokens, and
attention needs every earlier key. Of the three usual ways to get them, this module
all-gathers the keys and values of a layer over the cp group (the Llama 3 paper's choice,
section 3.3.2) rather than passing them around a ring or using torch's
``context_parallel`` API:

- with grouped-query attention the keys and values are a fraction of the activations
  (Llama 3 8B: 8 of 32 heads), so gathering them whole is cheap: one all-gather per layer
  (keys and values together, issued in line) against the ring's ``cp - 1`` steps;
- any mask is then local arithmetic: packed documents that cross the cp split are
  attended exactly, which ring attention needs per-block masks for;
- it runs on gloo as on NCCL (an all-gather forward, a reduce-scatter backward), where
  torch's API dispatches only to CUDA kernels and takes no document mask.

**Causal balance.** A row of ``T`` tokens is cut into ``2 cp`` chunks of ``L = T / 2cp``;
rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` (one from each end), so every rank's
queries see ``(2cp + 1) L`` keys between its two chunks and per-rank attention work is
equal (Megatron-LM's and torchtitan's head-tail layout).

**The kernel.** A chunk's queries see every key before the chunk and the chunk's own keys
causally: "lower-right" causal attention over more keys than queries. On CUDA that is
SDPA with :func:`torch.nn.attention.bias.causal_lower_right` (the fused
memory-efficient kernel, no mask built). On CPU, where that bias would be built as a
dense mask, :class:`_LowerRightCPU` runs the fused flash kernel twice (the earlier keys
unmasked, the chunk's own causally), merges the two by their log-sum-exps, and runs the
backward of each against the merged output, which is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from plugintrain.core.context_shard import ContextShard

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads ``(B, nkv, L, hs)`` repeated to ``heads`` query heads (GQA)."""
    groups = heads // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: each group of query heads summed into its key
    head."""
    B, heads, L, hs = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(B, kv_heads, heads // kv_heads, L, hs).sum(2)


class _LowerRightCPU(torch.autograd.Function):
    """Lower-right causal attention on CPU from two fused flash calls (see the module)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        prefix = k.size(2) - q.size(2)
        heads = q.size(1)
        ks, vs = _expand_heads(k, heads), _expand_heads(v, heads)
        o_pre, lse_pre = _flash_cpu(
            q, ks[:, :, :prefix], vs[:, :, :prefix], 0.0, False, scale=scale
        )
        o_own, lse_own = _flash_cpu(q, ks[:, :, prefix:], vs[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_pre, lse_own)  # (B, nh, Lq), fp32 (or fp64)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = o_pre.to(acc) * (lse_pre - lse).exp()[..., None]
        out = (out + o_own.to(acc) * (lse_own - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        prefix, heads, kv_heads = k.size(2) - q.size(2), q.size(1), k.size(1)
        ks, vs = _expand_heads(k, heads), _expand_heads(v, heads)
        grad_out = grad_out.contiguous()
        grads = [
            _flash_cpu_backward(
                grad_out, q, kp, vp, out, lse, 0.0, causal, attn_mask=None, scale=ctx.scale
            )
            for kp, vp, causal in (
                (ks[:, :, :prefix], vs[:, :, :prefix], False),
                (ks[:, :, prefix:], vs[:, :, prefix:], True),
            )
        ]
        dq = grads[0][0] + grads[1][0]
        dk = _fold_heads(torch.cat((grads[0][1], grads[1][1]), dim=2), kv_heads)
        dv = _fold_heads(torch.cat((grads[0][2], grads[1][2]), dim=2), kv_heads)
        return dq, dk, dv, None


def _lower_right_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """:class:`_LowerRightCPU` for any head sizes: the CPU flash kernel takes one head size
    for queries, keys and values, so values narrower than the queries (MLA) are padded
    with zero channels, and the output cut back."""
    hs, hs_v = q.size(-1), v.size(-1)
    if hs_v < hs:
        v = F.pad(v, (0, hs - hs_v))
    elif hs_v > hs:  # zero channels add nothing to q . k; the scale stays the queries'
        scale = hs**-0.5 if scale is None else scale
        q, k = F.pad(q, (0, hs_v - hs)), F.pad(k, (0, hs_v - hs))
    out = _LowerRightCPU.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale)
    return out[..., :hs_v] if hs_v < hs else out


def lower_right_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of ``q`` ``(B, nh, Lq, hs)`` over ``k``, ``v`` ``(B, nkv, Lk, hs)``
    with ``Lk >= Lq``, aligned at the end: query ``i`` sees keys ``0 .. Lk - Lq + i``.

    The queries are the last ``Lq`` positions of the keys' span, as a context-parallel
    chunk is of everything before it. Grouped-query heads as SDPA's ``enable_gqa``.
    """
    Lq, Lk = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if Lk == Lq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.device.type in ("cpu", "meta"):  # meta: a dry run traces the CPU path's shapes
        return _lower_right_cpu(q, k, v, scale)
    # The fused kernel behind the lower-right bias takes as many key heads as query heads.
    heads = q.size(1)
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(Lq, Lk), scale=scale
    )


class ContextAttention:
    """What attention runs under context parallelism: this rank's queries over the keys
    and values of the whole sequence, causally, and within documents for packed rows.

    Passed to the blocks where a mask would go (see
    :func:`~plugintrain.model_zoo.layers.attend`).

    Args:
        shard: This rank's share of the sequence.
        positions: Packed rows: ``(B, T)`` positions of the whole rows (0 where a document
            starts); None: each row is one sequence.
    """

    def __init__(self, shard: ContextShard, positions: torch.Tensor | None = None) -> None:
        self.shard = shard
        self.positions = positions
        self._pieces: list[list[list[tuple[int, int, int]]]] | None = None

    def pieces(self, seq_len: int) -> list[list[list[tuple[int, int, int]]]]:
        """Per row, per local chunk: ``(query start, query end, document start)`` in global
        positions, the parts of the chunk that lie in one document each."""
        if self._pieces is None:
            L = self.shard.chunk_length(seq_len)
            self._pieces = [
                [_chunk_pieces(begins, c * L, (c + 1) * L) for c in self.shard.chunks]
                for begins in document_starts(self.positions)
            ]
        return self._pieces

    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the local queries ``(B, nh, 2L, hs)`` over the local keys and values
        ``(B, nkv, 2L, hs)`` and every other cp rank's; ``(B, nh, 2L, hs_v)``."""
        # One all-gather of keys and values together (one reduce-scatter backward).
        kv = self.shard.gather(torch.cat((k, v), dim=-1))  # (B, nkv, T, hs + hs_v)
        # Each contiguous, so a chunk's keys are a view of them (no copy per chunk).
        k_all, v_all = (t.contiguous() for t in kv.split((k.size(-1), v.size(-1)), dim=-1))
        L, chunks = q.size(2) // 2, self.shard.chunks
        if self.positions is None:  # a row is one sequence: the whole batch at once
            whole = [[(c * L, (c + 1) * L, 0)] for c in chunks]
            return _attend_chunks(q, k_all, v_all, chunks, whole)
        rows = [
            _attend_chunks(q[b : b + 1], k_all[b : b + 1], v_all[b : b + 1], chunks, pieces)
            for b, pieces in enumerate(self.pieces(k_all.size(2)))
        ]
        return torch.cat(rows, dim=0)


def _attend_chunks(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    chunks: tuple[int, int],
    pieces: list[list[tuple[int, int, int]]],
) -> torch.Tensor:
    """Local queries ``q`` ``(b, nh, 2L, hs)`` of ``chunks`` over whole rows' keys and values:
    each of a chunk's ``pieces`` ``(start, end, document start)`` sees its document's keys
    up to its own end, causally."""
    L, parts = q.size(2) // 2, []
    for i, (c, chunk_pieces) in enumerate(zip(chunks, pieces, strict=True)):
        for start, end, doc in chunk_pieces:
            local = slice(i * L + start - c * L, i * L + end - c * L)
            parts.append(
                lower_right_attention(q[:, :, local], k_all[:, :, doc:end], v_all[:, :, doc:end])
            )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def document_starts(positions: torch.Tensor) -> list[list[int]]:
    """Where each row's documents begin, for packed rows of ``positions`` ``(B, T)``: at
    every position 0, and at the row's start (one host read)."""
    starts = (positions == 0).clone()
    starts[:, 0] = True
    return [[t for t, start in enumerate(row) if start] for row in starts.cpu().tolist()]


def _chunk_pieces(begins: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of ``[lo, hi)`` in one document each, ``(start, end, document start)``,
    for documents beginning at ``begins`` (sorted, starting with 0)."""
    pieces = []
    ends = [*begins[1:], float("inf")]
    for doc, nxt in zip(begins, ends, strict=True):
        start, end = max(lo, doc), min(hi, nxt)
        if start < end:
            pieces.append((start, int(end), doc))
    return pieces
