"""Multi-head latent attention (DeepSeek-V2, section 2.1; DeepSeek-V3).

Queries and keys/values pass through low-rank latents; RoPE acts on a separate
``qk_rope_head_dim`` part of each head (the "decoupled" RoPE), whose key is one vector
shared by all heads. What a token leaves in the KV cache is its normalized
``kv_lora_rank`` latent and its rotated shared key, not per-head keys and values:
DeepSeek-V3's 512 + 64 channels per token and layer against 128 heads x (192 + 128).

Plain single-device PyTorch, with head counts never baked into reshapes, so the
tensor-parallel plan can shard the heads of ``wq``/``wq_b``/``wkv_b`` from outside (the
latent projections stay replicated; the shared RoPE key passes through ``rope_key``, where
the plan sums its gradient over the head shards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugintrain.model_zoo.config import MLAConfig, TransformerConfig
from plugintrain.model_zoo.layers import Documents, apply_rope, attend, cache_mask

_LATENT_NORM_EPS = 1e-6
"""The latent norms' epsilon, whatever ``norm_eps`` the blocks' norms have: DeepSeek's
reference model (``inference/model.py``) and transformers' ``DeepseekV3Attention`` build
them with RMSNorm's default."""


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(..., T, r)`` whose channel pairs are adjacent, ``(2i, 2i + 1)``.

    ``cos``/``sin`` are the rotate-half tables ``(T, r)`` (angles repeated over the two
    halves); the result is laid out rotate-half style (all first members, then all
    second ones), as Hugging Face's ``apply_rotary_pos_emb_interleave`` returns it.
    Queries and keys go through the same permutation, so their dot products are those
    of the interleaved rotation.
    """
    half = cos.size(-1) // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LatentKVCache(nn.Module):
    """The compressed keys/values of past positions: each token's normalized latent
    ``(kv_lora_rank,)`` and its rotated shared RoPE key ``(qk_rope_head_dim,)``.

    The buffers are not persistent: a cache never ends up in a checkpoint.

    Args:
        batch_size: Largest batch the cache serves.
        max_seq_len: Largest number of positions it stores.
        mla: The attention's shape.
        device: Where to allocate the buffers.
        dtype: Dtype of the buffers (the model's activation dtype).
        pads: Left-padded prompts' pad counts ``(B,)`` (``layers.cache_mask``); None: none.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        mla: MLAConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        pads: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.pads = pads
        latent = torch.zeros(batch_size, max_seq_len, mla.kv_lora_rank, device=device, dtype=dtype)
        k_rope = torch.zeros(
            batch_size, 1, max_seq_len, mla.qk_rope_head_dim, device=device, dtype=dtype
        )
        self.register_buffer("latent", latent, persistent=False)
        self.register_buffer("k_rope", k_rope, persistent=False)

    def update(
        self, input_pos: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``latent`` ``(B, T, r_kv)`` and ``k_rope`` ``(B, 1, T, r)`` at ``input_pos``
        ``(T,)``; return every slot (in the dtype they are computed in, as
        ``layers.KVCache``)."""
        if self.latent.dtype != latent.dtype:
            self.latent, self.k_rope = self.latent.to(latent.dtype), self.k_rope.to(k_rope.dtype)
        B = latent.size(0)
        self.latent[:B, input_pos] = latent
        self.k_rope[:B, :, input_pos] = k_rope
        return self.latent[:B], self.k_rope[:B]

    def repeat(self, copies: int) -> None:
        """Each row ``copies`` times in a row (a prompt prefilled once for its group)."""
        self.latent = self.latent.repeat_interleave(copies, dim=0)
        self.k_rope = self.k_rope.repeat_interleave(copies, dim=0)
        if self.pads is not None:
            self.pads = self.pads.repeat_interleave(copies)


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention with decoupled RoPE.

    Module names follow torchtitan's DeepSeek-V3: ``wq`` (or ``wq_a``, ``q_a_norm``,
    ``wq_b``), ``wkv_a``, ``kv_a_norm``, ``wkv_b``, ``wo``.

    Args:
        config: Model architecture with ``attention="mla"``.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        d, nh = config.n_embd, config.n_head
        self.mla = mla
        self.dropout_p = config.dropout
        q_out = nh * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(d, q_out, bias=False)
            self.wq_a = self.q_a_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(d, mla.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(mla.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(mla.kv_lora_rank, eps=_LATENT_NORM_EPS)
        kv_out = nh * (mla.qk_nope_head_dim + mla.v_head_dim)  # every head's key and value
        self.wkv_b = nn.Linear(mla.kv_lora_rank, kv_out, bias=False)
        self.wo = nn.Linear(nh * mla.v_head_dim, d, bias=False)
        # The RoPE key every head shares passes here, so a tensor-parallel plan can sum its
        # gradient over the ranks' head shards (``head_shared``); an identity otherwise.
        self.rope_key = nn.Identity()
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache: LatentKVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | Documents | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``(B, T, C)`` causally; with a KV cache and ``input_pos``, also to the past.

        Args:
            x: Hidden states.
            rope: Cosines and sines for the T positions, ``(T, qk_rope_head_dim)`` each
                (``(B, 1, T, r)`` for packed rows).
            input_pos: Positions of the T tokens ``(T,)``; selects the KV cache path.
            mask: Packed rows' ``layers.Documents`` (or a dense ``(B, 1, T, T)`` bool
                mask, ``layers.document_mask``); None: causal over the whole row.
        """
        assert rope is not None, "multi-head latent attention needs RoPE tables"
        mla = self.mla
        B, T, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(B, T, -1, mla.qk_head_dim).transpose(1, 2)  # (B, nh, T, qk)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_norm(latent)  # (B, T, r_kv)
        k_rope = self.rope_key(k_rope.view(B, 1, T, mla.qk_rope_head_dim))  # one for all heads
        rotate = apply_rope_interleaved if mla.rope_interleave else apply_rope
        q_rope, k_rope = rotate(q_rope, *rope), rotate(k_rope, *rope)
        cached = self.kv_cache is not None and input_pos is not None
        if cached:
            latent, k_rope = self.kv_cache.update(input_pos, latent, k_rope)
            filled = int(input_pos[-1]) + 1  # expand only the positions written so far
            latent, k_rope = latent[:, :filled], k_rope[:, :, :filled]
        kv = self.wkv_b(latent).view(B, latent.size(1), -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.size(1), -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, nh, T, qk)
        if cached:
            mask = cache_mask(input_pos, k.size(2), self.kv_cache.pads)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            dropout_p = self.dropout_p if self.training else 0.0
            y = attend(q, k, v, mask, dropout_p)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * v_head_dim)
        return self.resid_dropout(self.wo(y))
