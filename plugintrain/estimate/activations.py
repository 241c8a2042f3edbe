"""What one micro-batch's forward saves for backward, and the peak of a rank's schedule.

Term by term per token (measured with :class:`~plugintrain.core.memory.LiveTensorMemory`
on the zoo's blocks, see :func:`block_saved_bytes`; a mixture-of-experts block by its
routed ``tokens x top_k`` assignments), times the micro-batches a pipeline rank holds at
once under its schedule (the schedule's own actions are walked), plus the largest
transient of the step: the loss's ``(B, T, V)`` gradients at the start of backward, or a
recomputed block. A quantized base (QLoRA) adds its largest weight dequantized for one
matmul, forward and backward (:func:`_dequantized`).

Under context parallelism every activation is of this rank's ``T / cp`` tokens
(:attr:`Layout.tokens`), but attention keeps the keys and values it gathered from the cp
group, whole rows of them: ``cp`` times the local keys' bytes
(:mod:`plugintrain.model_zoo.context_parallel`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from plugintrain.estimate.layout import Layout
from plugintrain.estimate.parameters import Param, layout_params, stage_of
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.strategies.pipeline_schedules import build_schedule
from plugintrain.strategies.pipeline_stages import rank_stages, stage_layer_keys


@dataclass(frozen=True)
class _Widths:
    """One tp rank's share of each activation width, and the bytes of each kind of value."""

    d: int
    """Residual width (whole: each tp rank holds it, or its sequence shard under SP)."""
    seq: float
    """Fraction of the sequence a tp rank holds in the residual stream (1 / tp under SP)."""
    dq: int
    """Query (and attention output) width on this rank: ``n_head * head_dim / tp``."""
    dkv: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    res: int
    """Bytes of a residual-stream value (fp32 unless the weights are bf16)."""
    act: int
    """Bytes of a matmul output (the autocast dtype under mixed precision)."""
    mixed: bool
    """Autocast: Linear layers save their own low-precision cast of an fp32 input."""
    kv: int = 0
    """Channels of the keys and values attention reads, together, on this rank (GQA:
    ``2 dkv``; MLA: every local head's key and value)."""
    cp: int = 1
    """Context-parallel ranks: attention keeps ``cp`` times the local tokens' keys."""

    @classmethod
    def of(cls, config: TransformerConfig, layout: Layout) -> _Widths:
        tp = layout.dims.tp
        low = 4 if layout.precision == "32-true" else 2
        mla = config.mla
        kv = 2 * config.kv_heads * config.head_dim
        if mla is not None:
            kv = config.n_head * (mla.qk_head_dim + mla.v_head_dim)
        return cls(
            d=config.n_embd,
            seq=1 / tp if layout.dims.sequence_parallel else 1.0,
            dq=config.n_head * config.head_dim // tp,
            dkv=config.kv_heads * config.head_dim // tp,
            heads=config.n_head // tp,
            kv_heads=config.kv_heads // tp,
            ffn=config.ffn_dim // tp,
            vocab=config.vocab_size // tp,
            res=2 if layout.precision == "bf16-true" else 4,
            act=low,
            mixed=layout.precision in ("bf16-mixed", "16-mixed"),
            kv=kv // tp,
            cp=layout.dims.cp,
        )


def block_saved_bytes(
    config: TransformerConfig, layout: Layout, recompute: str, index: int = 0
) -> float:
    """Bytes transformer block ``index`` saves for backward, per token of a micro-batch.

    Term by term, as measured with :class:`~plugintrain.core.memory.LiveTensorMemory` on the
    zoo's blocks (fp32 matches to the byte on gpt2/llama3/qwen3-debug): the block input;
    each norm's statistics (RMSNorm, a composite op, also keeps its normalized input); the
    norm output, which the Linear layers read (under autocast each keeps its own
    low-precision cast; under SP the all-gathered whole sequence); the attention inputs
    (after RoPE / qk-norm; the raw projections only where a qk-norm reads them), its output
    and log-sum-exp (fused attention, no T x T matrix); the residual sum; and the MLP's
    intermediates (GELU: 2, SwiGLU: 4 of the FFN width). ``selective`` keeps the block
    input, every matmul output, attention's outputs and the collectives' results; ``full``
    only the block input. A mixture-of-experts block's feed-forward is
    :func:`_moe_saved`'s instead of the MLP's.
    """
    w = _Widths.of(config, layout)
    sparse = config.moe is not None and config.moe.is_moe_layer(index)
    x = w.res * w.d * w.seq
    if recompute == "full":
        return x
    linears_in = (3, 2 if config.mlp == "swiglu" else 1)  # wq, wk, wv; w1 (, w3)
    if recompute == "selective":
        tp_collectives = (2 * w.res * w.d * w.seq if layout.dims.tp > 1 else 0) + (
            2 * w.res * w.d if layout.dims.sequence_parallel else 0
        )  # the rowwise outputs' reduction, the gathered inputs
        ffn = _moe_saved(config, w, matmuls_only=True) if sparse else w.act * linears_in[1] * w.ffn
        matmuls = w.dq + 2 * w.dkv + w.d + w.d
        return x + w.act * (matmuls + w.dq) + ffn + 4 * w.heads + tp_collectives
    norms = sum(_norm_saved(config, w, n) for n in linears_in)
    # Under cp the keys and values gathered over the cp group (whole rows) are kept.
    keys = 2 * w.dkv if w.cp == 1 else w.kv * w.cp
    attention = w.act * (w.dq + keys) + _qk_norm_saved(config, w)
    attention += w.act * w.dq + 4 * w.heads  # output and log-sum-exp (fp32)
    mlp = (4 if config.mlp == "swiglu" else 2) * w.ffn * w.act
    mlp = _moe_saved(config, w) if sparse else mlp
    return 2 * x + norms + attention + mlp  # x: the block input and the residual sum


def _moe_saved(config: TransformerConfig, w: _Widths, matmuls_only: bool = False) -> float:
    """A mixture-of-experts feed-forward's saved bytes per token, approximately (not
    measured): each of the ``top_k`` routed copies of a token keeps its gathered input,
    its expert's SwiGLU intermediates (4 of the expert width, as a dense SwiGLU) and its
    weighted output; the shared experts a SwiGLU of their width; the router its fp32 input
    and scores. Tensor parallelism does not split the layer (under SP each rank routes its
    own sequence shard); expert parallelism moves the copies, not their number.
    ``matmuls_only``: what selective recomputation keeps (the grouped and shared matmuls'
    outputs). Experts are assumed balanced: the padding to the busiest is not counted."""
    moe = config.moe
    shared = moe.n_shared_experts * moe.moe_intermediate_size
    width, k = moe.moe_intermediate_size, moe.top_k
    if matmuls_only:
        return w.act * w.seq * (k * (2 * width + w.d) + 2 * shared + w.d)
    routed = k * (2 * w.d + 4 * width) + 4 * shared + w.d
    return w.act * w.seq * routed + 4 * w.seq * (w.d + 2 * moe.n_routed_experts)


def _norm_saved(config: TransformerConfig, w: _Widths, readers: int) -> float:
    """A pre-norm's statistics and the output its ``readers`` Linear layers keep."""
    stats = 2 * 4 if config.norm == "layernorm" else w.res * w.d + 4  # RMSNorm: normalized x
    output = readers * w.act * w.d if w.mixed else w.res * w.d  # a cast each, or one shared
    return stats * w.seq + output  # the output is whole under SP (gathered before the Linears)


def _qk_norm_saved(config: TransformerConfig, w: _Widths) -> float:
    """Qwen3's query/key RMSNorm keeps its input, normalized input and statistics."""
    if not config.qk_norm:
        return 0
    return w.act * 2 * (w.dq + w.dkv) + 4 * (w.heads + w.kv_heads)


def _weight_casts(params: tuple[Param, ...], layout: Layout, places: set[int | str]) -> int:
    """Autocast's low-precision copy of each matmul weight of the blocks (or ``"last"``: the
    head) in ``places``, kept for backward by every forward (each pipeline micro-batch's
    forward casts anew); embedding lookups and norms cast nothing."""
    if layout.precision not in ("bf16-mixed", "16-mixed") or not places:
        return 0
    total = 0
    for p in params:
        lookup = p.name.startswith(("model.tok_embeddings.", "model.pos_embeddings."))
        if len(p.shape) == 2 and not lookup and stage_of(p.name) in places:
            total += 2 * math.prod(p.shape) // (layout.dims.tp if p.tp_dim is not None else 1)
    return total


@dataclass(frozen=True)
class _Chunk:
    """One virtual stage's activations for one micro-batch, in bytes."""

    saved: float
    """Kept from its forward until its backward."""
    forward_extra: float
    """Alive at the end of its forward only (the logits, autocast's cache)."""
    backward_extra: float
    """Alive at the start of its backward only (the loss gradients, a recomputed block)."""


def _chunk(
    config: TransformerConfig,
    layout: Layout,
    stage: int,
    layers: list[int],
    params: tuple[Param, ...],
) -> _Chunk:
    """The activations of virtual ``stage`` running ``layers`` for one micro-batch."""
    w = _Widths.of(config, layout)
    tokens = layout.tokens
    last = stage == layout.dims.pp * layout.dims.vpp - 1
    modes = {i: _recompute_mode(layout, i) for i in layers}
    kept = [i for i in layers if modes[i] == "none"]
    saved = tokens * sum(block_saved_bytes(config, layout, m, i) for i, m in modes.items())
    saved += _rope_tables(config, layout) if layers else 0
    saved += _weight_casts(params, layout, set(kept) | ({"last"} if last else set()))
    # Autocast's cache holds a recomputed block's casts until the forward ends.
    forward = _weight_casts(params, layout, set(layers) - set(kept))
    if stage == 0 and config.position == "learned":
        saved += 8 * layout.seq_len // w.cp  # the positions (int64), kept by the lookup
    # Backward of a block: what recomputation brings back, plus the gradients in flight
    # through it (about three FFN-wide and two residual-wide tensors).
    rerun = max(
        (
            block_saved_bytes(config, layout, "none", i)
            - block_saved_bytes(config, layout, modes[i], i)
            for i in layers
        ),
        default=0,
    )
    backward = tokens * (rerun + w.act * (3 * w.ffn + 2 * w.d)) if layers else 0.0
    if last:
        kept, during, after = _head(config, layout, w, tokens)
        head = "model.tok_embeddings." if config.tie_embeddings else "model.output."
        if any(p.trainable for p in params if p.name.startswith(head)):
            # The head weight's gradient, made whole beside the logits' before it is added
            # into its buffer.
            after += w.vocab * w.d * (2 if layout.precision == "bf16-true" else 4)
        saved += kept
        forward += during
        # The loss's backward; later the blocks' backward, by when the head's saved tensors
        # are freed.
        backward = max(after, backward - kept)
    else:
        saved += tokens * w.res * w.d * w.seq  # the stage output, stashed for backward
    if stage == 0 and not _frozen_embedding(params):
        # The embedding's backward makes a dense gradient of the whole (vocabulary-shard)
        # table before it lands in its bucket: on a pipeline's first rank, on top of the
        # micro-batches still in flight (by then this one's own tensors are freed).
        table = w.vocab * w.d * (2 if layout.precision == "bf16-true" else 4)
        if config.tie_embeddings and last:
            # Tied to the head on this stage: autograd holds the head's gradient of the
            # table until the embedding's arrives, then adds them into a third tensor.
            table *= 3
        backward = max(backward, table - saved)
    dequantized = _dequantized(params, layers)
    return _Chunk(saved, forward + dequantized, backward + dequantized)


def _head(
    config: TransformerConfig, layout: Layout, w: _Widths, tokens: int
) -> tuple[float, float, float]:
    """The head's bytes: what it keeps for backward, what is alive only while the loss
    runs, and the loss's own backward transient.

    Plain logits take the chunked cross-entropy
    (:func:`~plugintrain.model_zoo.cross_entropy.chunked_cross_entropy`): it keeps one
    buffer of the logits' gradient in their dtype, which backward returns as it is, beside
    the logits while it runs and one fp32 chunk of them (fp32 logits: written into the
    gradient's rows). Vocabulary-parallel logits (tp > 1) take torch's cross-entropy on
    an fp32 copy: its log-softmax (fp32) is kept, the logits and their fp32 copy live while
    it runs, and backward makes the fp32 gradients of log-probs and logits."""
    from plugintrain.model_zoo.cross_entropy import CHUNK_ELEMENTS

    head = tokens * (_norm_saved(config, w, 1) + w.res * w.d * w.seq)  # final norm, input
    logits = tokens * w.vocab
    if layout.dims.tp > 1:
        upcast = 4 if layout.precision == "32-true" else 6
        return head + 4 * logits, upcast * logits, 8 * logits
    chunk = 0 if w.act == 4 else 4 * min(tokens, max(1, CHUNK_ELEMENTS // w.vocab)) * w.vocab
    return head + w.act * logits, w.act * logits + chunk, 0.0


DEQUANTIZE_BYTES = 6
"""Bytes a weight while a quantized weight is dequantized for its matmul, forward or
backward (measured with :class:`~plugintrain.core.memory.LiveTensorMemory`: nf4's int32
lookup indices then fp32 values, or int8's fp32 values, then the compute dtype's copy)."""


def _dequantized(params: tuple[Param, ...], layers: list[int]) -> int:
    """The transient of dequantizing the largest quantized weight of ``layers``."""
    blocks = set(layers)
    return DEQUANTIZE_BYTES * max(
        (p.packs for p in params if p.packs and stage_of(p.name) in blocks), default=0
    )


def _frozen_embedding(params: tuple[Param, ...]) -> bool:
    """Whether the token embedding is frozen (LoRA): its backward makes no gradient."""
    return not any(p.trainable for p in params if p.name.startswith("model.tok_embeddings."))


def _recompute_mode(layout: Layout, index: int) -> str:
    if layout.blocks.activation_checkpointing == "full" and index % layout.blocks.every_n_layers:
        return "none"
    return layout.blocks.activation_checkpointing


def _rope_tables(config: TransformerConfig, layout: Layout) -> int:
    """The cosines and sines of the micro-batch's positions (this rank's, under cp),
    gathered once per forward."""
    positions = layout.seq_len // layout.dims.cp
    return 2 * 4 * positions * config.head_dim if config.position == "rope" else 0


def activation_bytes(config: TransformerConfig, layout: Layout, pp_rank: int) -> int:
    """Peak activation bytes of pipeline rank ``pp_rank`` (each tp rank alike).

    Walks the rank's actions in its pipeline schedule (one forward and backward without a
    pipeline): a forward adds its chunk's saved activations, a backward frees them, and
    each action's own transients come on top of what is held then. Under autocast every
    micro-batch forward also keeps its cast of the chunk's weights. With a pipeline, one
    received input and one gradient buffer (the executor's wire tensors) are added.
    """

    stages = layout.dims.pp * layout.dims.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.pipeline.layers_per_stage)
    params = layout_params(config, layout)
    chunks = [
        _chunk(config, layout, stage, [int(k) for k in keys[stage]], params)
        for stage in rank_stages(pp_rank, layout.dims.pp, layout.dims.vpp)
    ]
    peak = _schedule_peak(chunks, layout, pp_rank)
    if layout.dims.pp > 1:
        w = _Widths.of(config, layout)
        peak += 2 * 4 * layout.tokens * w.d * w.seq
    return math.ceil(peak)


@functools.lru_cache(maxsize=4)
def _schedule_actions(
    name: str, pp: int, vpp: int, microbatches: int
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each rank's ``(kind, chunk)`` in its schedule, built once for all of a layout's ranks
    (a 64-stage, 512-micro-batch schedule is 64k actions)."""
    schedule = build_schedule(name, pp, vpp, microbatches)
    return tuple(tuple((a.kind, a.chunk) for a in rank) for rank in schedule.actions)


def _schedule_peak(chunks: list[_Chunk], layout: Layout, pp_rank: int) -> float:
    """The most this rank holds at any action of its schedule."""
    if layout.dims.pp == 1:
        only = chunks[0]
        return only.saved + max(only.forward_extra, only.backward_extra)
    dims, options = layout.dims, layout.pipeline
    actions = _schedule_actions(options.schedule, dims.pp, dims.vpp, options.microbatches)
    held = peak = 0.0
    for kind, index in actions[pp_rank]:
        chunk = chunks[index]
        if kind == "F":
            held += chunk.saved
            peak = max(peak, held + chunk.forward_extra)
        else:
            peak = max(peak, held + chunk.backward_extra)
            held -= chunk.saved
    return peak
