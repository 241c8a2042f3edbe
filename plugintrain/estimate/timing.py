"""The scaling calculator: a layout's step time, tokens/s and MFU on a named cluster.

A step is priced from what each pipeline rank computes and sends in it
(:class:`StageCost`), read either from the model's shapes (:func:`formula_costs`, fast
enough to rank every layout of ``estimate --fit``) or from a dry run's traced step
(:func:`traced_costs`: the FLOPs and collectives of the real code path). :func:`predict`
turns them into time on a :class:`Cluster`:

* **compute**: matmul FLOPs at ``matmul_efficiency`` of the device's dense peak
  (:mod:`plugintrain.core.peak_flops`; at a power limit, times the clock the board
  sustains: :func:`power_limited_clock`), attention's at ``attention_efficiency`` (flash
  attention's kernels run further from the peak than large GEMMs); causal attention does
  half of the non-causal work. The memory-bound kernels (norms, RoPE, the MLP's
  activation, autocast's casts, residual adds, the cross-entropy, FSDP2's copies in and
  out of its flat buffers) by the bytes they move at the HBM bandwidth
  (:func:`block_elementwise`, :func:`head_elementwise`, :func:`fsdp_copies`).
* **collectives**: ring algorithms as nccl-tests prices them: an all-reduce of ``S`` bytes
  over ``n`` ranks moves ``2 (n-1)/n S`` per rank, an all-gather, reduce-scatter or
  all-to-all ``(n-1)/n S``, at the bus bandwidth of the link that carries the group
  (NVLink/NVSwitch when every rank of the group is in one node, else the network), plus a
  latency per call (``2 log2(nodes)`` hops across nodes).
* **context parallelism**: each rank computes on ``T / cp`` tokens of every row (its
  attention over whole rows: 1/cp of the causal work); per block and micro-batch the keys
  and values are all-gathered over the cp group in forward (again in a rerun forward) and
  their gradients reduce-scattered in backward; gradients reduce over dp x cp.
* **what overlaps**: tensor- and expert-parallel collectives, cp's K/V exchange and
  pipeline sends are exposed (they sit between the matmuls that need them); without a
  pipeline, the gradient reduction overlaps the backward (only what outlasts it is
  exposed), FSDP2's gathers and reduce-scatters overlap the compute but for its edges (its
  first two units' gathers before the first block, their reduce-scatters after the last
  backward: :func:`fsdp_edges`); with a pipeline the gradient engine
  reduces after the schedule's flush (plugintrain defers it there), exposed; ZeRO's
  parameter all-gather after the step is exposed; the optimizer step is memory-bound
  (state read and written at the HBM bandwidth).
* **the pipeline bubble**: the schedule simulator
  (:func:`~plugintrain.strategies.pipeline_schedules.simulate`) runs the layout's GPipe,
  1F1B or interleaved schedule with each virtual stage's own forward and backward time
  (its compute, its exposed collectives and its sends).

Not modelled: kernel launch and framework overheads, stragglers, the data loader. The
calculator is an upper bound a well-tuned run approaches; the README sets it against
published runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple

from plugintrain.core.peak_flops import DENSE_PEAK_FLOPS
from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig

if TYPE_CHECKING:
    from plugintrain.estimate.dry_run import DryRunReport
    from plugintrain.estimate.search import Estimate

_G = 1e9


@dataclass(frozen=True)
class Link:
    """An interconnect as one GPU sees it in a collective."""

    bandwidth: float
    """Bus bandwidth per GPU in bytes/s, as nccl-tests reports it for large messages."""
    latency: float
    """Seconds per call (per hop across nodes)."""


LINKS: dict[str, Link] = {
    # NVLink 4 through NVSwitch (H100/H200 SXM): 450 GB/s per direction; nccl-tests'
    # all-reduce bus bandwidth on 8 GPUs without NVLink SHARP is about 80% of it.
    "nvlink4": Link(360 * _G, 10e-6),
    # NVLink 3 (A100 SXM): 300 GB/s per direction, about 230 GB/s in nccl-tests.
    "nvlink3": Link(230 * _G, 10e-6),
    # One 400 Gb/s NIC per GPU (InfiniBand NDR or RoCE): 50 GB/s line rate, 90% of it.
    "ib-ndr400": Link(45 * _G, 8e-6),
    "roce-400": Link(45 * _G, 12e-6),
    # One 200 Gb/s InfiniBand HDR NIC per GPU (DGX A100): 25 GB/s line rate, 90% of it.
    "ib-hdr200": Link(22.5 * _G, 8e-6),
}
"""Named links; ``--intra_bw``, ``--inter_bw`` and the latencies override them."""


@dataclass(frozen=True)
class Cluster:
    """Devices and the links between them."""

    chip: str
    """A key of :data:`~plugintrain.core.peak_flops.DENSE_PEAK_FLOPS`."""
    gpus_per_node: int
    intra: Link
    """Between the GPUs of one node."""
    inter: Link
    """Between nodes."""
    hbm_bandwidth: float
    """Bytes/s of device memory (the optimizer step is bound by it)."""
    matmul_efficiency: float
    """Fraction of the dense peak large matmuls sustain."""
    attention_efficiency: float
    """Fraction of the dense peak the attention kernels sustain."""
    tensor_clock: float = 1.0
    """The clock the tensor cores sustain, relative to the one the chip's datasheet peak
    assumes: 1 for boards at their rated power, below 1 under a lower power limit
    (:func:`power_limited_clock`). Matmuls and attention run at the peak times this; MFU
    stays over the datasheet peak, as the runs' own MFU is."""

    def peak(self, precision: str) -> float:
        """Dense FLOP/s for matmuls under ``precision`` (TF32 for fp32): the datasheet's."""
        rates = DENSE_PEAK_FLOPS[self.chip]
        kind = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}.get(precision)
        return rates[kind] if kind else rates.get("tf32", rates["fp32"])

    def rate(self, precision: str) -> float:
        """Dense FLOP/s the tensor cores run at: :meth:`peak` at :attr:`tensor_clock`."""
        return self.peak(precision) * self.tensor_clock


def power_limited_clock(watts: float) -> float:
    """The H100 SXM's tensor rate at a ``watts`` power limit, relative to its datasheet
    peak: NVIDIA rates the H100 at 989.4 dense bf16 TFLOP/s on the 700 W SXM board and at
    835.5 on the 400 W NVL board; between them, linearly in the power limit. An estimate:
    torchtitan, whose H100s ran at 500 W, knows only that their peak lies between the
    two (886.8 TFLOP/s here, 0.896 of the SXM's)."""
    sxm, nvl = DENSE_PEAK_FLOPS["h100 sxm"]["bf16"], DENSE_PEAK_FLOPS["h100 nvl"]["bf16"]
    if not 400 <= watts <= 700:
        raise ValueError(f"watts={watts} is outside the rated boards' 400-700 W; pass 400-700")
    return (nvl + (sxm - nvl) * (watts - 400) / (700 - 400)) / sxm


CLUSTERS: dict[str, Cluster] = {
    # Efficiencies: cuBLAS sustains about 75% of the H100's dense bf16 peak on large GEMMs
    # and about 85% of the A100's. Attention is FlashAttention-2's, the kernel torch's
    # scaled_dot_product_attention runs first on both: 35% of the H100's peak
    # (FlashAttention-3 paper, arXiv:2407.08608, abstract; its charts at head dim 128 and
    # 8k tokens: forward 333-370 TFLOP/s, backward 318) and about 60% of the A100's
    # (FlashAttention-2 paper, forward and backward at head dim 128).
    "h100-ib": Cluster("h100 sxm", 8, LINKS["nvlink4"], LINKS["ib-ndr400"], 3.35e12, 0.75, 0.35),
    "h100-roce": Cluster("h100 sxm", 8, LINKS["nvlink4"], LINKS["roce-400"], 3.35e12, 0.75, 0.35),
    # H100 SXM boards with 96 GB of HBM2e (2.4 TB/s) at a 500 W power limit, RoCE at
    # 400 Gb/s a GPU: Meta's Grand Teton hosts, torchtitan's H100 benchmarks.
    "h100-500w-roce": Cluster(
        "h100 sxm",
        gpus_per_node=8,
        intra=LINKS["nvlink4"],
        inter=LINKS["roce-400"],
        hbm_bandwidth=2.4e12,
        matmul_efficiency=0.75,
        attention_efficiency=0.35,
        tensor_clock=power_limited_clock(500),
    ),
    "h200-ib": Cluster("h200", 8, LINKS["nvlink4"], LINKS["ib-ndr400"], 4.8e12, 0.75, 0.35),
    "a100-ib": Cluster("a100", 8, LINKS["nvlink3"], LINKS["ib-hdr200"], 2.0e12, 0.85, 0.60),
}
"""Named clusters: DGX-style nodes of 8 GPUs, one NIC per GPU (their names also in
:data:`plugintrain.estimate.names.CLUSTER_NAMES`, which ``--help`` lists without torch)."""


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind on one group in a step."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``."""
    dim: str
    """The mesh dimension of the group (``tp``, ``dp``, ``pp``, ``ep``, ``dp,tp``)."""
    group_size: int
    count: int
    bytes: int
    """Their whole buffers together (an all-gather's output, a reduce-scatter's input)."""


@dataclass(frozen=True)
class StageCost:
    """What one pipeline rank does in one step."""

    pp_rank: int
    matmul_flops: float
    """Executed matmul FLOPs (forward, backward, recomputation), this rank's shards."""
    attention_flops: float
    """Executed attention FLOPs (causal: half the non-causal work)."""
    collectives: tuple[Collective, ...]
    p2p_bytes: int
    """Bytes this rank sends to its pipeline neighbours in the step."""
    p2p_messages: int
    state_bytes: int
    """Parameters, gradients and optimizer state the optimizer step reads."""
    chunk_weights: tuple[float, ...] = ()
    """Each virtual stage's share of this rank's compute (equal when empty)."""
    memory_bytes: float = 0.0
    """Bytes the memory-bound kernels (norms, RoPE, activations, casts, residual adds,
    cross-entropy; FSDP2's copies) move through HBM (:func:`block_elementwise`,
    :func:`head_elementwise`, :func:`fsdp_copies`)."""
    fsdp_edge: tuple[Collective, ...] = ()
    """The part of FSDP2's traffic (counted in ``collectives`` too) that no compute can
    hide (:func:`fsdp_edges`)."""


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step on a cluster."""

    step_time: float
    tokens_per_step: int
    tokens_per_second: float
    tokens_per_second_per_gpu: float
    mfu: float
    """Model FLOPs (:meth:`TransformerConfig.flops_per_token`) per second over the peak."""
    tflops_per_gpu: float
    breakdown: dict[str, float]
    """Seconds of the step: ``compute`` (the busiest rank's matmuls and attention),
    ``memory-bound`` (its elementwise kernels), ``tp/ep/cp exposed``, ``p2p``, ``bubble``,
    ``dp exposed``, ``optimizer``."""


# ---- the costs of a step, from the model's shapes ---------------------------------------------


def _act_bytes(layout: Layout) -> int:
    """Bytes of an element of a matmul's output and its gradient (autocast's dtype), and
    of what pipeline stages send each other."""
    return 4 if layout.precision == "32-true" else 2


def _residual_bytes(layout: Layout) -> int:
    """Bytes of an element of the residual stream (and the norms' outputs, and the
    gradients flowing back into them): fp32 under mixed precision, where autocast leaves
    the residual adds, the norms and the embedding in fp32."""
    return 2 if layout.precision == "bf16-true" else 4


def _state_dtype_bytes(layout: Layout) -> int:
    return 2 if layout.precision == "bf16-true" else 4


def microbatches(layout: Layout) -> int:
    """Micro-batches per step on one pipeline (1 without one)."""
    return layout.pipeline.microbatches if layout.dims.pp > 1 else 1


def tokens_per_step(layout: Layout) -> int:
    """Tokens one optimizer step trains on: every dp replica's micro-batches."""
    return layout.dims.dp * microbatches(layout) * layout.micro_batch * layout.seq_len


def formula_costs(
    config: TransformerConfig, layout: Layout, memory: Estimate | None = None
) -> list[StageCost]:
    """Each pipeline rank's :class:`StageCost`, from the config's shapes and the layout
    (the collectives that the strategies' plans issue, counted per block; checked against
    traced steps in the tests). ``memory``: the layout's estimate, if already made."""
    from plugintrain.estimate.search import estimate
    from plugintrain.strategies.pipeline_stages import rank_stages, stage_layer_keys

    dims = layout.dims
    stages = dims.pp * dims.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.pipeline.layers_per_stage)
    memory = memory or estimate(config, layout)
    # The optimizer step of each stage's busiest rank.
    largest = {r.pp_rank: r for r in memory.stage_peaks()}
    costs = []
    for pp_rank in range(dims.pp):
        mine = rank_stages(pp_rank, dims.pp, dims.vpp)
        chunks = [_chunk(config, layout, s, [int(k) for k in keys[s]], stages) for s in mine]
        work = [c.matmul + c.attention for c in chunks]
        engine = _dp_collectives(config, layout, mine)
        memory_bytes = sum(_stage_elementwise(config, layout, s, keys) for s in mine)
        memory_bytes += fsdp_copies(engine, layout)
        collectives = [x for c in chunks for x in c.collectives] + engine
        cost = StageCost(
            pp_rank,
            matmul_flops=sum(c.matmul for c in chunks),
            attention_flops=sum(c.attention for c in chunks),
            collectives=tuple(_merge(collectives)),
            p2p_bytes=sum(c.sent for c in chunks),
            p2p_messages=sum(c.messages for c in chunks),
            state_bytes=sum(largest[pp_rank].training_state),
            chunk_weights=tuple(w / (sum(work) or 1.0) for w in work),
            memory_bytes=memory_bytes,
            fsdp_edge=fsdp_edges(config, layout),
        )
        costs.append(cost)
    return costs


class _ChunkCost(NamedTuple):
    """One virtual stage's part of a step."""

    matmul: float
    attention: float
    collectives: list[Collective]
    sent: int
    """Bytes sent to the neighbouring stages."""
    messages: int


def _chunk(
    config: TransformerConfig, layout: Layout, stage: int, blocks: list[int], stages: int
) -> _ChunkCost:
    """One virtual stage over the step: matmul and attention FLOPs, tp/ep collectives,
    bytes and messages it sends."""
    dims, m = layout.dims, microbatches(layout)
    tokens = layout.tokens  # this rank's share of the rows under cp
    act = tokens * config.n_embd * _act_bytes(layout)
    reruns = _reruns(layout)
    matmul = attention = 0.0
    moe_blocks = 0
    for index in blocks:
        block = config.block_flops(index, layout.seq_len)
        # Recomputation stops once backward has what it saved (torch.utils.checkpoint's
        # early stop): the block's last matmul, the FFN's down projection, is not rerun.
        rerun = block.matmul - block.down
        matmul += tokens / dims.tp * (3 * block.matmul + reruns * rerun)
        causal = tokens * block.attention / 2  # the lower triangle of scores and values
        attention += causal / dims.tp * (3 + reruns)
        moe_blocks += config.moe is not None and config.moe.is_moe_layer(index)
    if stage == stages - 1:
        matmul += 2 * tokens * config.vocab_size * config.n_embd / dims.tp * 3
    collectives = []
    if dims.tp > 1:
        first, last = stage == 0, stage == stages - 1
        again = _collective_reruns(layout)
        counts = _tp_counts(len(blocks), again, first, last, dims.sequence_parallel)
        width = tokens * config.n_embd * m
        residual, compute = width * _residual_bytes(layout), width * _act_bytes(layout)
        for op, (on_residual, on_compute) in counts.items():
            if on_residual + on_compute:
                nbytes = on_residual * residual + on_compute * compute
                collectives.append(
                    Collective(op, "tp", dims.tp, (on_residual + on_compute) * m, nbytes)
                )
        if last:  # the vocabulary-parallel loss: max, sum of exponentials, target logit
            collectives.append(Collective("all_reduce", "tp", dims.tp, 3 * m, 3 * m * tokens * 4))
    if dims.cp > 1 and blocks:
        collectives += _cp_collectives(config, layout, len(blocks))
    if dims.ep > 1 and moe_blocks:
        # Tokens go out as the norm's output (residual dtype) and come back as the
        # experts' (compute dtype); backward sends their gradients the other way.
        local = tokens // (dims.tp if dims.sequence_parallel else 1)
        both = config.n_embd * config.moe.top_k * (_residual_bytes(layout) + _act_bytes(layout))
        routed = local * both // 2
        # Dispatch and combine, each way, and again in a rerun forward.
        count = round((4 + 2 * _collective_reruns(layout)) * moe_blocks) * m
        collectives.append(Collective("all_to_all", "ep", dims.ep, count, count * routed))
    sends = 0
    if dims.pp > 1:
        sends = 2 * m - (stage == stages - 1) * m - (stage == 0) * m  # activations, gradients
    sent = act // (dims.tp if dims.sequence_parallel else 1)
    return _ChunkCost(matmul * m, attention * m, collectives, sends * sent, sends)


def kv_channels(config: TransformerConfig) -> int:
    """Channels of a token's keys and values together, as attention reads them: GQA's
    ``2 kv_heads head_dim``; MLA's per-head keys and values after the up-projection."""
    if config.mla is not None:
        return config.n_head * (config.mla.qk_head_dim + config.mla.v_head_dim)
    return 2 * config.kv_heads * config.head_dim


def _cp_collectives(config: TransformerConfig, layout: Layout, blocks: int) -> list[Collective]:
    """The K/V exchange of context parallelism over a virtual stage's ``blocks``, every
    micro-batch: per block one all-gather of the keys and values together, whole rows in
    the compute dtype (each of this rank's tp share), and in backward one reduce-scatter of
    their gradient; a block whose forward reruns in backward (full recomputation, or
    selective, which keeps the matmuls' outputs, not the gathered keys) gathers again."""
    dims, m = layout.dims, microbatches(layout)
    rows = layout.micro_batch * layout.seq_len * kv_channels(config) // dims.tp
    size = rows * _act_bytes(layout)  # an all-gather's output: K and V together
    gathers = (blocks + round(_collective_reruns(layout) * blocks)) * m
    return [
        Collective("all_gather", "cp", dims.cp, gathers, gathers * size),
        Collective("reduce_scatter", "cp", dims.cp, blocks * m, blocks * m * size),
    ]


def _stage_elementwise(
    config: TransformerConfig, layout: Layout, stage: int, keys: list[list[str]]
) -> float:
    """HBM bytes of virtual ``stage``'s memory-bound kernels over the step: each block's
    forward, twice that in backward, and again in a rerun forward (full recomputation's
    blocks; under selective recomputation every block's, which reruns its elementwise
    ops), plus the head's final norm and cross-entropy on the last stage."""
    tokens = layout.tokens * microbatches(layout)
    passes = 3 + _collective_reruns(layout)
    total = sum(passes * block_elementwise(config, layout, int(k)) for k in keys[stage])
    if stage == layout.dims.pp * layout.dims.vpp - 1:
        total += head_elementwise(config, layout)
    return tokens * total


def block_elementwise(config: TransformerConfig, layout: Layout, index: int) -> float:
    """HBM bytes per token (of this rank's) that block ``index``'s memory-bound kernels move
    in its forward, counted as eager PyTorch runs them: each kernel reads its inputs and
    writes its output once. Two pre-norms (RMSNorm, a composite of pow, mean and two
    multiplies: 6 accesses of the width; LayerNorm one fused read and write), autocast's
    cast of the norm's output for each Linear that reads it (mixed precision), RoPE on the
    queries and keys (two multiplies, the half rotation, the add: 10 accesses), the
    attention output's transpose to contiguous, two residual adds, the MLP's activation
    (SwiGLU: SiLU and the gate's multiply, 5 accesses of the FFN width; GELU 2), and under
    cp the gathered keys' and values' reordering into sequence order (4 accesses of whole
    rows). Under SP the norms and residual adds touch this rank's sequence shard."""
    dims, res, act = layout.dims, _residual_bytes(layout), _act_bytes(layout)
    tp, d = dims.tp, config.n_embd
    seq = 1 / tp if dims.sequence_parallel else 1.0
    norm = (6 if config.norm == "rmsnorm" else 2) * d * res * seq
    readers = 3 + (2 if config.mlp == "swiglu" else 1)  # wq, wk, wv; w1 (, w3)
    casts = readers * d * (res + act) if layout.precision.endswith("-mixed") else 0
    q, kv = config.n_head * config.head_dim // tp, kv_channels(config) // tp
    rope = 10 * (q + kv / 2) * config.rope_dim / config.head_dim * act
    attention = 2 * q * act + (4 * kv * dims.cp * act if dims.cp > 1 else 0)
    residual = 2 * 3 * d * res * seq
    moe = config.moe
    if moe is not None and moe.is_moe_layer(index):
        width = moe.top_k * moe.moe_intermediate_size + moe.n_shared_experts * (
            moe.moe_intermediate_size
        )
    else:
        width = config.ffn_dim
    mlp = (5 if config.mlp == "swiglu" or moe is not None else 2) * width // tp * act
    return 2 * norm + casts + rope + attention + residual + mlp


def head_elementwise(config: TransformerConfig, layout: Layout) -> float:
    """HBM bytes per token of the head's memory-bound kernels over forward and backward:
    the final norm (as a block's, three passes) and the cross-entropy on this rank's
    vocabulary shard of the logits: log-softmax in fp32 (a max, a sum of exponentials,
    its output: 4 accesses) and its backward (3), and under mixed precision the logits'
    cast to fp32 and their gradient's back."""
    dims, act = layout.dims, _act_bytes(layout)
    seq = 1 / dims.tp if dims.sequence_parallel else 1.0
    norm = (6 if config.norm == "rmsnorm" else 2) * config.n_embd * _residual_bytes(layout)
    vocab = config.vocab_size / dims.tp
    casts = 2 * (act + 4) if layout.precision.endswith("-mixed") else 0
    return 3 * norm * seq + vocab * (7 * 4 + casts)


def _reruns(layout: Layout) -> float:
    """Forwards a block reruns in backward: 1 with full recomputation (of every n-th
    block: 1/n on average), else 0 (selective recomputation reruns only the elementwise
    ops between the matmuls, which the calculator does not price)."""
    full = layout.blocks.activation_checkpointing == "full"
    return full / layout.blocks.every_n_layers


def _collective_reruns(layout: Layout) -> float:
    """Forwards whose collectives a block reissues in backward: :func:`_reruns`, and 1
    under selective recomputation too (its policy keeps the matmuls' outputs, not the
    collectives', as the traced steps show)."""
    selective = layout.blocks.activation_checkpointing == "selective"
    return 1.0 if selective else _reruns(layout)


def _tp_counts(
    blocks: int, reruns: float, first: bool, last: bool, sequence_parallel: bool
) -> dict[str, tuple[int, int]]:
    """Tensor-parallel collectives of one micro-batch through a virtual stage, each kind's
    calls on the residual stream's dtype and on the matmuls' (autocast's) dtype.

    Per block with SP: an all-gather of each norm's output (residual dtype) before
    attention and the FFN, a reduce-scatter of each row-parallel matmul's output (compute
    dtype); in backward their transposes, on the gradients of those same tensors; a rerun
    forward repeats the gathers and the first reduce-scatter (recomputation stops before
    the last matmul). Without SP an all-reduce of each row-parallel output, and of each
    column-parallel input's gradient in backward. The embedding all-reduces its
    vocabulary shards (with SP its backward gathers); the head gathers the sequence (its
    backward scatters), or without SP all-reduces its input's gradient. Checked against
    real ranks under CPU autocast (``tests/distributed/test_traffic_distributed.py``)."""
    again = round(reruns * blocks)
    if sequence_parallel:
        return {
            "all_gather": (2 * blocks + 2 * again + first + last, 2 * blocks),
            "reduce_scatter": (2 * blocks + last, 2 * blocks + again),
            "all_reduce": (int(first), 0),
        }
    return {"all_reduce": (2 * blocks + first + last, 2 * blocks + again)}


def _dp_collectives(
    config: TransformerConfig, layout: Layout, stages: list[int]
) -> list[Collective]:
    """The gradient reduction and parameter gathering of one step (over dp x cp, named
    ``dp``; ``edp`` x cp for expert weights) and the tied embedding's gradient sum across
    the pipeline."""
    from plugintrain.estimate.parameters import layout_params, stage_params

    dims = layout.dims
    pp_rank = stages[0] % dims.pp
    held = [p for p in stage_params(layout_params(config, layout), config, layout, pp_rank)]
    tied = config.tie_embeddings and layout.lora is None and pp_rank in (0, dims.pp - 1)
    out = []
    if dims.dp * dims.cp > 1 and layout.stage is not None:
        for expert in (False, True):
            # Over dp x cp: the cp ranks hold other tokens of the same rows.
            group = (dims.dp // dims.ep if expert else dims.dp) * dims.cp
            size = sum(
                p.size * p.element_size() for p in held if p.trainable and p.expert == expert
            )
            if group < 2 or not size:
                continue
            dim = "edp" if expert else "dp"
            # With a pipeline the engine buckets each chunk apart (each launches when its
            # chunk's last backward has run), and a tied weight apart (summed first).
            apart = dims.vpp - 1 + (tied and not expert) if dims.pp > 1 else 0
            out += _engine_collectives(layout, dim, group, size, apart)
    if dims.pp > 1 and tied:
        size = config.vocab_size * config.n_embd // dims.tp * _state_dtype_bytes(layout)
        out.append(Collective("all_reduce", "pp", 2, 1, size))
    return out


def _engine_collectives(
    layout: Layout, dim: str, group: int, size: int, apart: int = 0
) -> list[Collective]:
    """ZeRO 0/1: all-reduce the gradients (1: then all-gather the updated parameters);
    ZeRO-2: reduce-scatter and all-gather; FSDP2: gather the parameters in the compute
    dtype for forward and again for backward, reduce-scatter the gradients in fp32, every
    micro-batch (``size``: the gradients' bytes; ``apart``: buckets beyond those of the
    bucket size)."""
    stage, m = layout.stage, microbatches(layout)
    if stage == 3:
        gathered = size * _act_bytes(layout) // _state_dtype_bytes(layout)
        return [
            Collective("all_gather", dim, group, 2 * m, 2 * m * gathered),
            Collective("reduce_scatter", dim, group, m, m * size),
        ]
    reduce = "reduce_scatter" if stage == 2 else "all_reduce"
    buckets = max(1, math.ceil(size / (layout.bucket_size_mb * 2**20))) + apart
    out = [Collective(reduce, dim, group, buckets, size)]
    if stage in (1, 2):
        out.append(Collective("all_gather", dim, group, buckets, size))
    return out


def fsdp_copies(collectives: Iterable[Collective], layout: Layout) -> float:
    """HBM bytes of FSDP2's copies around its ``collectives`` (torch's
    ``foreach_all_gather`` and ``foreach_all_gather_copy_out``, ``foreach_reduce``): each
    gather's output copied out into the unsharded parameters (read and written in the
    compute dtype) and its input copied in from this rank's shards (read in the state
    dtype, written cast); each reduce-scatter's input, the unsharded gradients
    chunk-concatenated into one buffer and cast from the compute dtype to fp32. 0 for the
    other ZeRO stages."""
    if layout.stage != 3:
        return 0.0
    act, state = _act_bytes(layout), _state_dtype_bytes(layout)
    total = 0.0
    for c in collectives:
        if c.op == "all_gather":
            total += 2 * c.bytes + c.bytes / c.group_size * (1 + state / act)
        elif c.op == "reduce_scatter":
            total += c.bytes * (1 + act / state)
    return total


def fsdp_edges(config: TransformerConfig, layout: Layout) -> tuple[Collective, ...]:
    """FSDP2's traffic that no compute can hide: the gathers of its first two units (the
    parameters outside the blocks, which the embedding needs, then the first block's)
    before the first block can run, and their reduce-scatters, which start after their
    last backward, the step's last (the first block's has only the embedding's backward
    left to hide under). Empty without FSDP2 (which runs without a pipeline)."""
    from plugintrain.estimate.parameters import layout_params, stage_params

    dims = layout.dims
    group = dims.dp * dims.cp
    if layout.stage != 3 or group < 2:
        return ()
    held = stage_params(layout_params(config, layout), config, layout, 0)
    first = min((p.block for p in held if p.block is not None), default=None)
    size = sum(p.size * p.element_size() for p in held if p.trainable and p.block in (None, first))
    gathered = size * _act_bytes(layout) // _state_dtype_bytes(layout)
    return (
        Collective("all_gather", "dp", group, 2, gathered),
        Collective("reduce_scatter", "dp", group, 2, size),
    )


def _merge(collectives: Iterable[Collective]) -> list[Collective]:
    merged: dict[tuple, Collective] = {}
    for c in collectives:
        key = (c.op, c.dim, c.group_size)
        old = merged.get(key)
        if old is not None:
            c = dataclasses.replace(old, count=old.count + c.count, bytes=old.bytes + c.bytes)
        merged[key] = c
    return sorted(merged.values(), key=lambda c: (c.dim, c.op))


# ---- the costs of a step, from a traced dry run -----------------------------------------------


def traced_costs(
    report: DryRunReport, config: TransformerConfig, layout: Layout
) -> list[StageCost]:
    """Each pipeline rank's :class:`StageCost` from a dry run's traced ranks (one per
    stage: the first traced rank of each): its FLOPs (attention's from the traced
    ``bmm``/attention operators, halved: the trace runs the non-causal math path), its
    collectives per mesh dimension (:func:`calculator_dim`) and its sends; the memory-bound
    kernels' bytes and FSDP2's unhidden part are the shapes' (:func:`formula_costs`)."""
    costs: dict[int, StageCost] = {}
    shapes = formula_costs(config, layout)  # what a trace does not see
    for r in report.ranks:
        if r.trace is None or r.pp_rank in costs:
            continue
        t = r.trace
        attention = sum(v for k, v in t.flops_by_op.items() if _is_attention(k)) / 2
        collectives = [
            Collective(c.op, calculator_dim(c.op, c.dim, layout), c.group_size, c.count, c.bytes)
            for c in t.traffic
            if c.op not in ("send", "recv")
        ]
        costs[r.pp_rank] = StageCost(
            r.pp_rank,
            matmul_flops=t.flops - 2 * attention,
            attention_flops=attention,
            collectives=tuple(_merge(collectives)),
            p2p_bytes=sum(n for kind, _, n in t.p2p if kind == "send"),
            p2p_messages=sum(kind == "send" for kind, _, _ in t.p2p),
            state_bytes=sum(r.training_state),
            memory_bytes=shapes[r.pp_rank].memory_bytes,
            fsdp_edge=shapes[r.pp_rank].fsdp_edge,
        )
    missing = sorted(set(range(layout.dims.pp)) - set(costs))
    if missing:
        raise ValueError(
            f"no traced rank of pipeline stage(s) {missing}; trace one rank of every stage"
            " (--ranks sample)"
        )
    return [costs[p] for p in range(layout.dims.pp)]


def calculator_dim(op: str, dim: str, layout: Layout) -> str:
    """The calculator's name for traffic the recorder saw on mesh dimension(s) ``dim``:
    the data-parallel group flattened with cp (``dp,cp``; ``edp,ep,cp`` with experts) is
    ``dp``, and the experts' ``edp,cp`` is ``edp``; with dp 1 that group is the cp group
    itself, where an all-reduce is the gradients' (the K/V exchange gathers and
    scatters)."""
    named = {"dp,cp": "dp", "edp,ep,cp": "dp", "edp,cp": "edp"}
    if dim == "cp" and op == "all_reduce" and layout.dims.dp == 1:
        return "dp"
    return named.get(dim, dim)


def _is_attention(op: str) -> bool:
    return "bmm" in op or "attention" in op


# ---- time ---------------------------------------------------------------------------------------


def group_link(cluster: Cluster, layout: Layout, dim: str, group_size: int) -> Link:
    """The link a group of mesh dimension ``dim`` runs over: NVLink when its ranks, ``stride``
    apart in the mesh (order ``pp, dp, cp, tp``; ``ep`` and ``edp`` inside ``dp``), fit in
    one node."""
    span = _stride(layout, dim) * (group_size - 1) + 1
    return cluster.intra if span <= cluster.gpus_per_node else cluster.inter


def collective_time(c: Collective, link: Link, nodes: int = 1) -> float:
    """Seconds for ``c`` on ``link``: ring bandwidth terms (nccl-tests' bus bandwidth) and
    a latency per call (``2 log2 nodes`` hops across nodes)."""
    n = c.group_size
    if n < 2:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(c.op, (n - 1) / n)
    hops = 2 * max(1, math.ceil(math.log2(nodes))) if nodes > 1 else 1
    return c.bytes * factor / link.bandwidth + c.count * link.latency * hops


def _nodes(cluster: Cluster, layout: Layout, c: Collective) -> int:
    link = group_link(cluster, layout, c.dim, c.group_size)
    if link is cluster.intra:
        return 1
    per_node = max(1, cluster.gpus_per_node // max(1, _stride(layout, c.dim)))
    return max(2, math.ceil(c.group_size / per_node))


def _stride(layout: Layout, dim: str) -> int:
    """How far apart in the mesh (order ``pp, dp, cp, tp``; ``ep`` and ``edp`` inside
    ``dp``) the ranks of a group of mesh dimension ``dim`` are (``tp`` and ``dp,tp``:
    adjacent; ``dp``, the dp x cp ranks flattened: ``tp``)."""
    dims = layout.dims
    tp, cp = dims.tp, dims.cp
    strides = {
        "cp": tp,
        "ep": tp * cp,
        "dp": tp,
        "edp": tp * cp * dims.ep,
        "pp": tp * cp * dims.dp,
    }
    return strides.get(dim, 1)


def predict(
    costs: list[StageCost], config: TransformerConfig, layout: Layout, cluster: Cluster
) -> Prediction:
    """The step of ``layout`` on ``cluster`` from each pipeline rank's costs (see the module
    for what is priced and what overlaps)."""
    from plugintrain.strategies.pipeline_schedules import build_schedule, simulate

    dims, m = layout.dims, microbatches(layout)
    peak = cluster.peak(layout.precision)
    times = [_rank_times(cost, layout, cluster) for cost in costs]
    compute, exposed, p2p, reductions, after = (list(column) for column in zip(*times, strict=True))
    memory = [c.memory_bytes / cluster.hbm_bandwidth for c in costs]  # inside compute
    optimizer = max(c.state_bytes for c in costs) * 2 / cluster.hbm_bandwidth
    if dims.pp > 1:
        stage_times = _stage_times(costs, compute, exposed, p2p, layout)
        schedule = build_schedule(layout.pipeline.schedule, dims.pp, dims.vpp, m)
        simulation = simulate(schedule, stage_times=stage_times)
        makespan = float(simulation.makespan) * 1e-9
        late = _reductions_after_flush(simulation, costs, reductions, layout)
    else:
        makespan = compute[0] + exposed[0]
        # The gradient reduction runs under the backward (two thirds of the compute);
        # FSDP2's gathers and reductions under all of it, but for its edges.
        hidden = compute[0] * (1 if layout.stage == 3 else 2 / 3)
        edge = sum(_collective_seconds(c, layout, cluster) for c in costs[0].fsdp_edge)
        late = [edge + max(0.0, reductions[0] - edge - hidden)]
    after = [a + b for a, b in zip(after, late, strict=True)]
    step = makespan + max(after) + optimizer
    busiest = max(range(len(costs)), key=lambda i: compute[i])
    idle = makespan - compute[busiest] - exposed[busiest] - p2p[busiest]
    bubble = max(0.0, idle) if dims.pp > 1 else 0.0
    tokens = tokens_per_step(layout)
    per_second = tokens / step
    model_flops = config.flops_per_token(layout.seq_len) * per_second / dims.world_size
    return Prediction(
        step_time=step,
        tokens_per_step=tokens,
        tokens_per_second=per_second,
        tokens_per_second_per_gpu=per_second / dims.world_size,
        mfu=model_flops / peak,
        tflops_per_gpu=model_flops / 1e12,
        breakdown={
            "compute": compute[busiest] - memory[busiest],
            "memory-bound": memory[busiest],
            "tp/ep/cp exposed": exposed[busiest],
            "p2p": p2p[busiest],
            "bubble": bubble,
            "dp exposed": max(after),
            "optimizer": optimizer,
        },
    )


def _rank_times(
    cost: StageCost, layout: Layout, cluster: Cluster
) -> tuple[float, float, float, float, float]:
    """One pipeline rank's seconds: compute (its memory-bound kernels' bytes at the HBM
    bandwidth included), exposed collectives inside it, pipeline sends, the gradient
    reduction that may overlap the backward, and what runs after it."""
    rate = cluster.rate(layout.precision)
    compute = cost.matmul_flops / (rate * cluster.matmul_efficiency) + cost.attention_flops / (
        rate * cluster.attention_efficiency
    )
    compute += cost.memory_bytes / cluster.hbm_bandwidth
    t = {"inside": 0.0, "overlapped": 0.0, "after": 0.0}
    for c in cost.collectives:
        t[_overlap(c, layout)] += _collective_seconds(c, layout, cluster)
    link = group_link(cluster, layout, "pp", 2)
    p2p = cost.p2p_bytes / link.bandwidth + cost.p2p_messages * link.latency
    return compute, t["inside"], p2p, t["overlapped"], t["after"]


def _collective_seconds(c: Collective, layout: Layout, cluster: Cluster) -> float:
    link = group_link(cluster, layout, c.dim, c.group_size)
    return collective_time(c, link, _nodes(cluster, layout, c))


def _overlap(c: Collective, layout: Layout) -> str:
    """``inside`` a micro-batch's compute (exposed: tp and ep, and cp's K/V exchange, which
    the attention waits for: issued in line, as the Llama 3 paper's all-gather sits on the
    critical path), ``overlapped`` with the backward (the gradient reduction, launched
    bucket by bucket; FSDP2's traffic, with all the compute), or ``after`` the step's last
    backward (exposed: ZeRO's parameter gather, the tied weight's sum across the
    pipeline)."""
    if c.dim in ("tp", "ep", "cp"):
        return "inside"
    if layout.stage == 3 or (c.dim in ("dp", "edp") and c.op != "all_gather"):
        return "overlapped"
    return "after"


def _reductions_after_flush(
    simulation: Any, costs: list[StageCost], reductions: list[float], layout: Layout
) -> list[float]:
    """Per pipeline rank, how long its gradient reduction runs past the schedule's end:
    each chunk's buckets are launched once its last backward of the step has run
    (``overlap_comm``), one chunk after the other, each taking its share of the rank's
    reduction time."""
    dims = layout.dims
    end = float(simulation.makespan)
    late = []
    for cost, total in zip(costs, reductions, strict=True):
        weights = cost.chunk_weights or (1 / dims.vpp,) * dims.vpp
        done: dict[int, float] = {}
        for slot in simulation.timeline[cost.pp_rank]:
            if slot.action.kind == "B":
                done[slot.action.chunk] = float(slot.end)
        clock = 0.0
        for chunk in sorted(done, key=done.__getitem__):
            clock = max(clock, done[chunk]) + total * 1e9 * weights[chunk]
        late.append(max(0.0, clock - end) * 1e-9)
    return late


def _stage_times(
    costs: list[StageCost],
    compute: list[float],
    exposed: list[float],
    p2p: list[float],
    layout: Layout,
) -> list[tuple[Fraction, Fraction]]:
    """Each virtual stage's forward and backward time of one micro-batch, in nanoseconds:
    its share of its rank's compute and exposed collectives (a third forward, two thirds
    backward; recomputation adds a forward to the backward) and its sends."""
    dims, m = layout.dims, microbatches(layout)
    forward = 1 / (3 + _reruns(layout))
    times: list[tuple[Fraction, Fraction]] = [(Fraction(0), Fraction(0))] * (dims.pp * dims.vpp)
    for cost, busy, tp, sends in zip(costs, compute, exposed, p2p, strict=True):
        weights = cost.chunk_weights or (1 / dims.vpp,) * dims.vpp
        messages = sends / max(1, 2 * m * dims.vpp)
        for chunk, w in enumerate(weights):
            per = (busy + tp) * w / m
            f = per * forward + messages
            b = per * (1 - forward) + messages
            times[chunk * dims.pp + cost.pp_rank] = (_ns(f), _ns(b))
    return times


def _ns(seconds: float) -> Fraction:
    return Fraction(max(1, round(seconds * 1e9)))


MODELLED = (
    "modelled: tp/ep/cp collectives and pipeline sends exposed, elementwise kernels at the"
    " HBM bandwidth; without a pipeline the gradient reduction overlaps the backward,"
    " FSDP2's traffic the compute (but its first gathers and last reduce-scatters); with one it"
    " follows the flush; ZeRO's parameter gather exposed; no kernel or framework overhead"
)
"""One line naming what the calculator overlaps (printed under every prediction)."""
