"""Transformer building blocks: norms, rotary embeddings, attention, feed-forward, KV cache.

Plain single-device PyTorch. Head counts are never baked into reshapes (``view(B, T, -1,
hs)``), so a tensor-parallel plan can shard the heads of ``wq``/``wk``/``wv`` from outside.
"""

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from plugintrain.model_zoo.config import RopeScaling, TransformerConfig
from plugintrain.model_zoo.context_parallel import ContextAttention, document_starts


def build_norm(config: TransformerConfig) -> nn.Module:
    """Return the normalization layer named by ``config.norm`` over ``n_embd`` channels."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, one per channel pair: ``(head_dim // 2,)``.

    Args:
        head_dim: Channels per attention head (even).
        theta: Base period.
        scaling: Llama 3.1 frequency scaling, applied when given.
        device: Where to build the tensor.
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    return inv_freq if scaling is None else _scale_llama3(inv_freq, scaling)


def _scale_llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1 (reference `apply_scaling` in meta-llama/llama-models): keep high frequencies,
    # slow the low ones by `factor`, interpolate smoothly in between.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(
        wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
    )
    is_medium = (wavelen >= old_len / scaling.high_freq_factor) & (
        wavelen <= old_len / scaling.low_freq_factor
    )
    return torch.where(is_medium, interpolated, scaled)


def rope_cache(
    config: TransformerConfig, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines for every position up to ``block_size``: two ``(block_size, r)``
    over the ``r = config.rope_dim`` rotated channels of a head (all of them, but MLA's).

    Uses the rotate-half layout (frequencies repeated over the two halves of a head), as Hugging
    Face does, so its Llama weights load without permuting ``wq``/``wk``.
    """
    inv_freq = rope_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling, device)
    positions = torch.arange(config.block_size, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (block_size, hs / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (block_size, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, nh, T, hs)`` by the angles of its positions: ``(T, hs)``,
    or ``(B, 1, T, hs)`` when each row has its own positions (packed sequences)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # pairs channel i with channel i + hs/2
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The dense attention mask of packed sequences: causal within each document, nothing
    across (what :class:`Documents` computes without it; kept as its reference and for
    ``packed_attention="dense"``).

    A document starts wherever its position is 0 (a packed row holds several examples,
    each numbered from 0), so a token sees the earlier tokens of its own example only: the
    block-diagonal causal mask that makes a packed row compute what its examples compute
    one at a time.

    Args:
        positions: ``(B, T)`` position of each token within its document.

    Returns:
        ``(B, 1, T, T)`` bool, True where the query (row) may attend to the key (column).
    """
    document = (positions == 0).cumsum(dim=-1)  # (B, T) index of each token's document
    same = document[:, :, None] == document[:, None, :]  # (B, T, T)
    causal = torch.ones(
        positions.size(-1), positions.size(-1), dtype=torch.bool, device=positions.device
    ).tril_()
    return (same & causal)[:, None]  # (B, 1, T, T)


class Documents:
    """Where the documents of packed rows lie, for attention within each of them without a
    ``T x T`` mask: memory linear in the row length, and no work on the blocks between
    documents.

    Each document is one causal :func:`~torch.nn.functional.scaled_dot_product_attention`
    over its own span of queries, keys and values, with no mask: SDPA's fused kernels where
    their conditions hold (on CPU the flash kernel, without dropout; on CUDA flash or
    memory-efficient attention, by dtype and head sizes), which keep a log-sum-exp rather
    than attention weights for the backward. The dense mask costs ``(B, T, T)`` bytes and
    the whole row's attention in any case. Each row is split once into its documents, so
    the backward gathers each row's gradient once, however many documents it holds.

    Inside a compiled graph (``compile: true``, with or without recomputation) the dense
    mask is traced instead, from :attr:`positions`: a graph that depends on the spans would
    recompile for every packing.

    Args:
        positions: ``(B, T)`` position of each token within its document (0 where one
            starts); the spans are read from it on first use (one host sync a forward).
    """

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._lengths: list[list[int]] | None = None

    @classmethod
    def of(cls, positions: torch.Tensor) -> "Documents":
        """The documents of ``positions`` ``(B, T)``: a document starts at each 0, and at
        the row's start."""
        return cls(positions)

    @property
    def spans(self) -> list[list[tuple[int, int]]]:
        """Each row's documents, ``(start, end)`` in order, covering the row."""
        return [list(itertools.pairwise(itertools.accumulate([0, *row]))) for row in self.lengths]

    @property
    def lengths(self) -> list[list[int]]:
        """Each row's documents' lengths, in order (read once)."""
        if self._lengths is None:
            T = self.positions.size(-1)
            self._lengths = [
                [e - s for s, e in itertools.pairwise([*begins, T])]
                for begins in document_starts(self.positions)
            ]
        return self._lengths

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """Causal attention of ``q`` ``(B, nh, T, hs)`` within each document over ``k``,
        ``v`` ``(B, nkv, T, hs)`` (grouped-query heads as ``enable_gqa``); ``(B, nh, T,
        hs_v)``."""
        gqa = q.size(1) != k.size(1)
        if torch.compiler.is_compiling():  # traced once, whatever the packing
            mask = document_mask(self.positions)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa
            )
        rows = []
        for qb, kb, vb, lengths in zip(
            q.unbind(0), k.unbind(0), v.unbind(0), self.lengths, strict=True
        ):
            parts = [
                F.scaled_dot_product_attention(
                    qd, kd, vd, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
                )
                for qd, kd, vd in zip(
                    qb.split(lengths, dim=1),
                    kb.split(lengths, dim=1),
                    vb.split(lengths, dim=1),
                    strict=True,
                )
            ]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return torch.stack(rows)


def packed_mask(positions: torch.Tensor, how: str = "documents") -> "Documents | torch.Tensor":
    """What packed rows of ``positions`` ``(B, T)`` attend under: their :class:`Documents`
    (``how="documents"``: one fused causal attention a document, memory linear in the
    row), or the dense :func:`document_mask` (``"dense"``: the reference, for comparison)."""
    return document_mask(positions) if how == "dense" else Documents.of(positions)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: "torch.Tensor | Documents | ContextAttention | None",
    dropout_p: float,
) -> torch.Tensor:
    """Causal attention of ``q`` over ``k``, ``v`` (``(B, heads, T, hs)``): over the whole
    row (``mask`` None), within each document of packed rows (:class:`Documents`), or
    under a dense ``(B, 1, T, T)`` bool mask (:func:`document_mask`); under context
    parallelism, this rank's queries over every rank's keys (a
    :class:`~plugintrain.model_zoo.context_parallel.ContextAttention`, which has no
    dropout: the strategy refuses dropout with cp)."""
    if isinstance(mask, ContextAttention):
        return mask.attend(q, k, v)
    if isinstance(mask, Documents):
        return mask.attend(q, k, v, dropout_p)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=mask is None,
        enable_gqa=q.size(1) != k.size(1),
    )


def cache_mask(input_pos: torch.Tensor, slots: int, pads: torch.Tensor | None) -> torch.Tensor:
    """Which of a KV cache's ``slots`` the queries at ``input_pos`` ``(T,)`` attend to:
    slot ``s`` from the query at slot ``p`` when ``s <= p`` (later slots are not written
    yet), ``(T, slots)``. With left-padded rows (``pads`` ``(B,)``, each row's count), also
    not a row's pad slots: ``(B, 1, T, slots)``. A pad's own query sees itself, so the pad
    slots hold finite values (a query that saw nothing would write NaN, and a NaN value
    poisons even a zero attention weight)."""
    keys = torch.arange(slots, device=input_pos.device)
    mask = input_pos[:, None] >= keys  # (T, slots)
    if pads is None:
        return mask
    real = keys >= pads[:, None]  # (B, slots)
    itself = input_pos[:, None] == keys  # (T, slots)
    return mask & (real[:, None, None, :] | itself)  # (B, 1, T, slots)


class KVCache(nn.Module):
    """Keys and values of past positions, for incremental decoding.

    The buffers are not persistent: a cache never ends up in a checkpoint.

    Args:
        batch_size: Largest batch the cache serves.
        max_seq_len: Largest number of positions it stores.
        n_kv_head: Key/value heads per layer.
        head_dim: Channels per head.
        device: Where to allocate the buffers.
        dtype: Dtype of the buffers (the model's activation dtype).
        pads: Left-padded prompts: each row's pad count ``(B,)``, slots no query of the row
            attends to (:func:`cache_mask`); None: no padding.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        n_kv_head: int,
        head_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        pads: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, n_kv_head, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.pads = pads

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``(B, nkv, T, hs)`` at ``input_pos`` ``(T,)``; return every slot.
        The buffers take the dtype the keys are computed in (autocast, FSDP2's mixed
        precision) at the first store."""
        if self.k.dtype != k.dtype:
            self.k, self.v = self.k.to(k.dtype), self.v.to(v.dtype)
        B = k.size(0)
        self.k[:B, :, input_pos] = k
        self.v[:B, :, input_pos] = v
        return self.k[:B], self.v[:B]  # (B, nkv, max_seq_len, hs)

    def repeat(self, copies: int) -> None:
        """Each row ``copies`` times in a row (a prompt prefilled once for its group)."""
        self.k = self.k.repeat_interleave(copies, dim=0)
        self.v = self.v.repeat_interleave(copies, dim=0)
        if self.pads is not None:
            self.pads = self.pads.repeat_interleave(copies)


QK_NORM_PLAN = {
    "layers.*.attention.q_norm": "head_norm",
    "layers.*.attention.k_norm": "head_norm",
}
"""Tensor-parallel plan entries of the query/key norms (``qk_norm``), for any family: after
the column-parallel ``wq``/``wk`` each tp rank holds whole heads, so the norms run on the
local heads (``head_norm``, see :func:`plugintrain.strategies.tensor_parallel.style`)."""


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, optional rotary embeddings and
    optional per-head query/key RMSNorm (``config.qk_norm``, Qwen3).

    Args:
        config: Model architecture.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, hs = config.n_embd, config.head_dim
        self.head_dim = hs
        self.dropout_p = config.dropout
        self.wq = nn.Linear(d, config.n_head * hs, bias=config.bias)
        self.wk = nn.Linear(d, config.kv_heads * hs, bias=config.bias)
        self.wv = nn.Linear(d, config.kv_heads * hs, bias=config.bias)
        self.wo = nn.Linear(config.n_head * hs, d, bias=config.bias)
        self.q_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else None
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_pos: torch.Tensor | None = None,
        mask: "torch.Tensor | Documents | None" = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``(B, T, C)`` causally; with a KV cache and ``input_pos``, also to the past.

        Args:
            x: Hidden states.
            rope: Cosines and sines for the T positions, ``(T, hs)`` each (``(B, 1, T, hs)``
                for packed rows); None without RoPE.
            input_pos: Positions of the T tokens ``(T,)``; selects the KV cache path.
            mask: Packed rows: their :class:`Documents` (or a dense ``(B, 1, T, T)`` bool
                mask, :func:`document_mask`); None: causal over the whole row.
        """
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, nh, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, hs)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:  # per head, over its hs channels (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.kv_cache is not None and input_pos is not None:
            y = self._attend_cached(q, k, v, input_pos)
        else:
            dropout_p = self.dropout_p if self.training else 0.0
            y = attend(q, k, v, mask, dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.wo(y))

    def _attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
    ) -> torch.Tensor:
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, nkv, max_seq_len, hs)
        mask = cache_mask(input_pos, k.size(2), self.kv_cache.pads)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=q.size(1) != k.size(1)
        )  # (B, nh, T, hs)


class MLP(nn.Module):
    """GPT-2 feed-forward network: ``w2(gelu(w1(x)))`` with the tanh GELU approximation.

    Args:
        config: Model architecture.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.w2 = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, C)`` to ``(B, T, C)``."""
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))


class SwiGLU(nn.Module):
    """Gated feed-forward network ``w2(silu(w1(x)) * w3(x))`` (Shazeer 2020, used by Llama).

    Args:
        config: Model architecture.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)  # gate
        self.w3 = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)  # down
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, C)`` to ``(B, T, C)``."""
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def build_feed_forward(config: TransformerConfig) -> nn.Module:
    """Return the feed-forward network named by ``config.mlp``."""
    return SwiGLU(config) if config.mlp == "swiglu" else MLP(config)
