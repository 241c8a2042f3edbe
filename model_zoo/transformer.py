"""The decoder-only transformer shared by every family (GPT-2, Llama 3, ...).

Attribute names are an interface: tensor-parallel plans key on module paths such as
``layers.0.attention.wq``, and :meth:`Transformer.keep_stage` deletes entries of the
``layers`` ``ModuleDict`` (keeping the others' names) and sets ``tok_embeddings``, ``norm`` or
``output`` to None on the pipeline stages that do not own them (torchtitan's layout).
``embed`` / ``run_layers`` / ``head`` are the pieces a stage runs: the model implements
:class:`plugintrain.core.contracts.StagedModel`, and strategies need nothing else of it.
"""

import math
from collections.abc import Collection, Iterable

import torch
from torch import nn

from plugintrain.core.context_shard import ContextShard
from plugintrain.core.initialization import draw_seed, seeded_normal_
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.context_parallel import ContextAttention
from plugintrain.model_zoo.layers import (
    Attention,
    Documents,
    KVCache,
    build_feed_forward,
    build_norm,
    packed_mask,
    rope_cache,
)
from plugintrain.model_zoo.mla import LatentKVCache, MultiHeadLatentAttention
from plugintrain.model_zoo.moe import MoE
from plugintrain.model_zoo.quantization import QuantizedWeight


class TransformerBlock(nn.Module):
    """Pre-norm block: attention, then feed-forward, each on a residual branch.

    Args:
        config: Model architecture.
        index: The block's place in the model (MoE configs keep the first blocks dense).
    """

    def __init__(self, config: TransformerConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = build_norm(config)
        mla = config.attention == "mla"
        self.attention = MultiHeadLatentAttention(config) if mla else Attention(config)
        self.ffn_norm = build_norm(config)
        sparse = config.moe is not None and config.moe.is_moe_layer(index)
        self.feed_forward = MoE(config) if sparse else build_feed_forward(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_pos: torch.Tensor | None = None,
        mask: "torch.Tensor | Documents | None" = None,
    ) -> torch.Tensor:
        """Map hidden states ``(B, T, C)`` to ``(B, T, C)``; see :meth:`Attention.forward`."""
        h = x + self.attention(self.attention_norm(x), rope, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCaches:
    """The KV caches of a :class:`Transformer`'s attention layers, for generation."""

    config: TransformerConfig
    layers: nn.ModuleDict
    context: ContextShard | None
    kv_pads: torch.Tensor | None = None
    """Each row's left pads while the caches hold padded prompts (:meth:`setup_kv_cache`)."""

    def setup_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        pads: torch.Tensor | None = None,
    ) -> None:
        """Give every attention layer a KV cache (generation only). Generation sees whole
        sequences: a context-parallel split (:attr:`Transformer.context`) is set aside until
        :meth:`clear_kv_cache`.

        Args:
            batch_size: Largest batch to decode.
            max_seq_len: Prompt plus generated tokens; at most ``block_size``.
            device: Cache device; defaults to the model's.
            dtype: Cache dtype; defaults to the model's parameter dtype.
            pads: Prompts of several lengths, left-padded to one: each row's pad count
                ``(B,)``. A row's tokens then take positions from its first real token,
                and no query attends to its pads (``layers.cache_mask``); None (or all 0):
                no pads.
        """
        if max_seq_len > self.config.block_size:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds block_size={self.config.block_size}; "
                f"shorten the prompt or generate fewer tokens."
            )
        if self.context is not None:
            self._context_aside, self.context = self.context, None
        weight = next(self.parameters())
        device, dtype = device or weight.device, dtype or weight.dtype
        config = self.config
        if pads is not None and not bool(pads.any()):  # rows of one length: the plain mask
            pads = None
        self.kv_pads = pads
        for layer in self.layers.values():
            layer.attention.kv_cache = (
                LatentKVCache(batch_size, max_seq_len, config.mla, device, dtype, pads)
                if config.mla is not None
                else KVCache(
                    batch_size, max_seq_len, config.kv_heads, config.head_dim, device, dtype, pads
                )
            )

    def repeat_kv_cache(self, copies: int) -> None:
        """Repeat each row of the caches ``copies`` times in a row: prompts prefilled once,
        then decoded as ``copies`` rows each (a group of samples)."""
        for layer in self.layers.values():
            layer.attention.kv_cache.repeat(copies)
        if self.kv_pads is not None:
            self.kv_pads = self.kv_pads.repeat_interleave(copies)

    def clear_kv_cache(self) -> None:
        """Drop the KV caches, freeing their memory (and restore a context-parallel split)."""
        self.kv_pads = None
        for layer in self.layers.values():
            layer.attention.kv_cache = None
        if getattr(self, "_context_aside", None) is not None:
            self.context, self._context_aside = self._context_aside, None


class Transformer(KVCaches, nn.Module):
    """Token ids in, next-token logits out.

    Construct under ``torch.device("meta")`` for large models, then ``to_empty(device=...)``
    and :meth:`init_weights`. Off the meta device the constructor initializes the weights
    itself. Either way the weights derive from :attr:`init_seed`, drawn from the global
    generator first thing (construction itself consumes no other random numbers), so
    seeding before construction gives the same weights on every device and layout.

    Args:
        config: Model architecture.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.init_seed = draw_seed()
        """What every weight's values derive from (see :meth:`init_weights`)."""
        self.packed_attention = "documents"  # or "dense": see layers.packed_mask
        self.context: ContextShard | None = None
        """Context parallelism: this rank's share of every sequence (set by the strategy);
        the pieces below then take whole rows of tokens and positions and compute on this
        rank's two chunks of them (:mod:`~plugintrain.model_zoo.context_parallel`)."""
        # Submodules' default inits move the global generator on CPU, not on meta (overwritten).
        with torch.random.fork_rng(devices=[]):
            self._build(config)
        if self.output.weight.device.type != "meta":
            self.init_weights()

    def _build(self, config: TransformerConfig) -> None:
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_embeddings = (
            nn.Embedding(config.block_size, config.n_embd) if config.position == "learned" else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, i) for i in range(config.n_layer)}
        )
        self.norm = build_norm(config)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._tie_embeddings()
        # Derived from the config, so not persistent: checkpoints hold only weights.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        if config.position == "rope":
            self.rope_cos, self.rope_sin = rope_cache(config)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every weight this module holds and rebuild the RoPE buffers, in place.

        Normal(0, ``init_std``) for embeddings and Linear weights, scaled by
        ``1 / sqrt(2 * n_layer)`` for the projections that write into the residual stream
        (``wo``, ``w2``, the experts' ``w2``; GPT-2 paper, section 2.3), zero biases, unit
        norm weights, zero routing biases. Normal
        values come from :func:`~plugintrain.core.initialization.seeded_normal_` keyed by each
        parameter's full-model name (a tied head by the embedding's), so a pipeline stage
        or a tensor-parallel / FSDP2 shard initialized on its own holds exactly its part
        of the one-process weights. A base weight held quantized (QLoRA) is drawn whole
        under its name, then quantized.
        """
        self.init_buffers()
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        canonical = {b: a for a, b in self.tied_parameters()}
        for module_name, module in self.named_modules():
            if isinstance(module, QuantizedWeight):  # QLoRA: drawn whole, then quantized
                full = torch.empty(module.shape, dtype=module.dtype, device=module.device)
                is_residual = module_name.endswith((".wo.weight", ".w2.weight"))
                std_here = residual_std if is_residual else std
                module.quantize_(seeded_normal_(full, std_here, self.init_seed, module_name))
                continue
            for name, param in module.named_parameters(prefix=module_name, recurse=False):
                if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and name.endswith("weight"):
                    nn.init.ones_(param)
                elif name.endswith("bias"):
                    nn.init.zeros_(param)
                else:
                    is_residual = module_name.endswith((".wo", ".w2")) or name.endswith(
                        "experts.w2"
                    )
                    key = canonical.get(name, name)
                    seeded_normal_(param, residual_std if is_residual else std, self.init_seed, key)

    def init_buffers(self) -> None:
        """Re-tie the head (``to_empty()`` replaces each parameter on its own, untying them)
        and rebuild the RoPE tables on their device: what :meth:`init_weights` does besides
        drawing weights, for weights that are loaded instead."""
        self._tie_embeddings()
        if self.rope_cos is not None:
            self.rope_cos, self.rope_sin = rope_cache(self.config, device=self.rope_cos.device)
        for _, moe in self.moe_layers():
            moe.router.expert_bias.zero_()  # loaded weights that have one overwrite it
            moe.reset_counts()

    def _tie_embeddings(self) -> None:
        if (
            self.config.tie_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
        ):
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute logits ``(B, T, V)`` for token ids ``(B, T)``.

        On a pipeline stage without ``tok_embeddings`` the input is hidden states ``(B, T, C)``,
        and without ``norm``/``output`` the hidden states are returned.

        Args:
            tokens: Token ids, or hidden states on a later pipeline stage.
            input_pos: Positions of the T tokens ``(T,)``; None means ``0..T-1``. Needed to
                read and write the KV cache set up by :meth:`setup_kv_cache`.
            positions: Packed rows instead: ``(B, T)`` position of each token in its own
                example, 0 where an example starts; attention does not cross examples
                (:func:`~plugintrain.model_zoo.layers.packed_mask`).
        """
        h = self.features(tokens, input_pos, positions)
        return self.head(h) if self.output is not None else h  # (B, T, V)

    def features(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states after the last block ``(B, T, C)``, before the final norm and
        the head: :meth:`forward` without the logits (arguments as there)."""
        if positions is not None:
            pos = positions
        elif input_pos is not None and self.kv_pads is not None:  # left-padded rows
            pos = (input_pos[None] - self.kv_pads[:, None]).clamp_min(0)  # (B, T)
        elif input_pos is not None:
            pos = input_pos
        else:
            pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.embed(tokens, pos) if self.tok_embeddings is not None else tokens  # (B, T, C)
        return self.run_layers(h, self.layers.keys(), pos, input_pos)

    # ---- the pieces a pipeline stage runs (plugintrain.core.contracts.StagedModel) -----------

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` at ``positions`` ``(T,)`` (or ``(B, T)``, each row's) ->
        hidden states ``(B, T, C)``; under context parallelism, of this rank's chunks:
        ``(B, T / cp, C)``."""
        if self.context is not None:
            tokens, positions = self.context.take(tokens), self.context.take(positions, -1)
        h = self.tok_embeddings(tokens)  # (B, T, C)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)  # (T, C) broadcast over the batch, or (B, T, C)
        return self.dropout(h)

    def run_layers(
        self,
        h: torch.Tensor,
        keys: Iterable[str],
        positions: torch.Tensor,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states through ``layers[key]`` for each of ``keys``, in order.

        Args:
            h: Hidden states ``(B, T, C)``, or sequence shards of them under SP.
            keys: Block keys (full-model indices as strings).
            positions: Positions of the whole sequence ``(T,)`` (for RoPE), or each row's
                ``(B, T)``: packed rows (also masks attention at their example boundaries),
                or left-padded rows decoding with a KV cache (``input_pos`` given; the
                cache masks the pads).
            input_pos: As in :meth:`forward`, for the KV cache.
        """
        rope = mask = None
        if self.context is not None:  # whole rows' positions -> this rank's, and its attention
            packed = positions.dim() == 2
            mask = ContextAttention(self.context, positions if packed else None)
            positions = self.context.take(positions, -1)
        if self.rope_cos is not None:
            rope = (self.rope_cos[positions], self.rope_sin[positions])  # (T, r) or (B, T, r)
        if positions.dim() == 2:  # packed or padded rows: per-row angles (B, 1, T, r)
            rope = None if rope is None else (rope[0][:, None], rope[1][:, None])
            if mask is None and input_pos is None:  # packed rows: their documents
                mask = packed_mask(positions, self.packed_attention)
        for key in keys:
            h = self.layers[key](h, rope, input_pos, mask)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: hidden states -> logits ``(B, T, V)``."""
        return self.output(self.norm(h))

    def keep_stage(self, layer_keys: Collection[str], first: bool, last: bool) -> None:
        """Keep only one pipeline rank's modules, in place, under their full-model names.

        Args:
            layer_keys: The blocks to keep.
            first: Whether this rank runs the first stage (keeps the embeddings).
            last: Whether it runs the last stage (keeps the final norm and the head; a head
                tied to the embedding stays that same ``Parameter``).
        """
        for key in [k for k in self.layers if k not in layer_keys]:
            del self.layers[key]
        if not first:
            self.tok_embeddings = None
            self.pos_embeddings = None
        if not last:
            self.norm = None
            self.output = None

    def tied_parameters(self) -> list[tuple[str, str]]:
        """``[("tok_embeddings.weight", "output.weight")]`` when the head is tied, else none."""
        return [("tok_embeddings.weight", "output.weight")] if self.config.tie_embeddings else []

    def moe_layers(self) -> list[tuple[str, MoE]]:
        """``(block key, MoE layer)`` of every mixture-of-experts block this module holds."""
        return [
            (key, layer.feed_forward)
            for key, layer in self.layers.items()
            if isinstance(layer.feed_forward, MoE)
        ]

    def take_aux_loss(self) -> torch.Tensor | None:
        """The MoE balance losses of the training forwards since the last call, summed over
        the layers held here (None when there are none: no MoE, or a zero coefficient)."""
        losses = [loss for _, moe in self.moe_layers() if (loss := moe.take_aux_loss()) is not None]
        return torch.stack(losses).sum() if losses else None
