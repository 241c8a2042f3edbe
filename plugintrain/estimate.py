"""Per-rank memory of a training layout, computed from the config: no weights are built.

:func:`estimate` answers "how many bytes does each rank hold?" for a
:class:`~plugintrain.model_zoo.TransformerConfig` and a :class:`Layout` (dp x tp (+sp) x
pp (x vpp), the ZeRO stage, precision, micro-batch, sequence length, recomputation, LoRA),
rank by rank, in five parts:

- **parameters, gradients, optimizer state**: exactly what the strategies keep between
  steps. The model is built once on the meta device (so names, shapes, tied weights and
  LoRA adapters are the real ones), each parameter is cut as the tensor-parallel plan
  cuts it (and a mixture of experts' stacked expert weights as expert parallelism does:
  ``1/ep`` of the experts each) and kept on the pipeline stages that hold it, and the
  gradient engine's own :func:`~plugintrain.strategies.buckets.assign_buckets` and
  padding lay it out in flat buckets: a rank holds every bucket's parameters and, at
  ZeRO 0/1, its gradients (ZeRO-2: the owned slice, 1/dp of a bucket, or 1/(dp/ep) of an
  expert bucket, which is reduced over the ranks holding the same experts); AdamW keeps
  ``exp_avg`` and ``exp_avg_sq`` in the parameters' dtype plus a 4-byte ``step`` per
  tensor it steps (the owned slices under ZeRO-1/2). Without the engine (one device)
  each trainable parameter has its own ``.grad``. FSDP2 (``zero_stage=3``) shards every
  parameter's first dim, padded.
- **activations**: what one micro-batch's forward saves for backward, term by term per
  token (measured with :class:`~plugintrain.core.memory.LiveTensorMemory` on the zoo's blocks,
  see :func:`block_saved_bytes`; a mixture-of-experts block by its routed ``tokens x
  top_k`` assignments), times the micro-batches a pipeline rank holds at once
  under its schedule (the schedule's own actions are walked), plus the largest transient
  of the step: the loss's ``(B, T, V)`` gradients at the start of backward, or a
  recomputed block.
- **communication**: gradient buffers alive only during backward (ZeRO-2's full buckets
  in flight, a pipeline's whole local gradient before its reduce-scatter) and FSDP2's
  gathered blocks.

The biggest rank decides whether a layout fits: :meth:`Estimate.peak`. :func:`fitting_layouts`
enumerates layouts over up to N devices and keeps those under a memory limit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plugintrain.model_zoo.config import TransformerConfig

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("single", "ddp_bucketed", "zero1", "zero2", "hybrid")
"""``single``: one device, Lightning's own loop; ``ddp_bucketed``/``zero1``/``zero2``: the
ZeroStrategy names (data parallelism only); ``hybrid``: dp x tp x pp with ``zero_stage``."""
_ENGINE_STAGE = {"ddp_bucketed": 0, "zero1": 1, "zero2": 2}
_STEP_BYTES = 4  # AdamW's `step`: a float32 scalar tensor per parameter it steps
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """A training layout, named as ``plugintrain estimate``'s options (and the strategies'
    arguments) name it. Validated on construction; :meth:`check` validates it against a model.
    """

    strategy: str = "hybrid"
    """One of :data:`STRATEGIES`."""
    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel ranks."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Model chunks per pipeline rank."""
    ep: int = 1
    """Expert-parallel ranks, borrowed from the dp ranks (models with MoE layers only)."""
    zero_stage: int = 0
    """``hybrid``'s ZeRO stage: 0, 1, 2 (our engine) or 3 (FSDP2); set by the other names."""
    precision: str = "32-true"
    """One of :data:`PRECISIONS`."""
    micro_batch: int = 1
    """Sequences per micro-batch on one rank (the per-rank batch when pp = 1)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    microbatches: int | None = None
    """Micro-batches per step with pp > 1; None: pp."""
    schedule: str | None = None
    """Pipeline schedule; None: ``1f1b``, or ``interleaved`` with vpp > 1."""
    layers_per_stage: tuple[int, ...] | None = None
    """Blocks of each virtual stage, in stage order (pp x vpp of them); None: equal."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``full`` or ``selective``."""
    every_n_layers: int = 1
    """With ``full``: recompute blocks 0, n, 2n, ... only."""
    lora_r: int = 0
    """LoRA rank; 0: no LoRA (every parameter trains)."""
    lora_targets: tuple[str, ...] = ("*.attention.wq", "*.attention.wv")
    """Globs of the Linear layers LoRA adapts (the LoRA callback's default)."""
    bucket_size_mb: float = 25.0
    """The gradient engine's bucket size."""

    def __post_init__(self) -> None:
        from plugintrain.strategies.blocks import BlockOptions

        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        sizes = {"micro_batch": self.micro_batch, "seq_len": self.seq_len, "dp": self.dp}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or v < 1}
        if bad or self.lora_r < 0 or not self.bucket_size_mb > 0:
            bad |= {"lora_r": self.lora_r} if self.lora_r < 0 else {}
            raise ValueError(f"these must be positive: {bad or {'bucket_size_mb': 0}}")
        BlockOptions(self.recompute, self.every_n_layers, strategy_name="estimate")
        if self.strategy == "single" and self.world_size > 1:
            raise ValueError(
                f"strategy='single' runs on one device, got dp={self.dp} x tp={self.tp} x"
                f" pp={self.pp}; use strategy 'hybrid' (or zero1/zero2 for data parallelism)"
            )
        if self.strategy in _ENGINE_STAGE and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                f"strategy={self.strategy!r} is data parallelism only, got tp={self.tp},"
                f" pp={self.pp}; use strategy 'hybrid' with zero_stage"
                f" {_ENGINE_STAGE[self.strategy]}"
            )

    @property
    def world_size(self) -> int:
        """Ranks: dp x tp x pp."""
        return self.dp * self.tp * self.pp

    @property
    def stage(self) -> int | None:
        """The gradient engine's ZeRO stage (3: FSDP2); None without data parallelism's
        engine (one device under Lightning's own loop)."""
        if self.strategy == "single":
            return None
        return _ENGINE_STAGE.get(self.strategy, self.zero_stage)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step (1 without a pipeline)."""
        if self.pp == 1:
            return 1
        return self.pp if self.microbatches is None else self.microbatches

    def check(self, config: TransformerConfig) -> None:
        """Raise a one-line ``ValueError`` naming the value and the fix if ``config`` cannot
        train on this layout; the strategies' own checks, before any process would start."""
        from plugintrain.strategies.mesh import ParallelDims
        from plugintrain.strategies.pipeline_stages import PipelineOptions, check_layers

        if self.dp % self.ep:  # a model without experts: say so, not that dp is too small
            ParallelDims(expert_parallel=self.ep).validate_experts(config)
        if self.seq_len > config.block_size:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds {config.name}'s block_size="
                f"{config.block_size}; use seq_len <= {config.block_size}"
            )
        if self.zero_stage == 3 and self.pp > 1:
            raise ValueError(
                f"zero_stage=3 (FSDP2) cannot be combined with pp={self.pp}; use zero_stage 1 or 2"
            )
        dims = ParallelDims(
            world_size=self.world_size,
            data_parallel=self.dp,
            tensor_parallel=self.tp,
            sequence_parallel=self.sp,
            pipeline_parallel=self.pp,
            virtual_pipeline_parallel=self.vpp,
            expert_parallel=self.ep,
            zero_stage=self.stage or 0,
        )
        dims.validate_model(config, self.seq_len)
        if self.pp > 1:
            check_layers(config.n_layer, self.pp, self.vpp, self.layers_per_stage)
            PipelineOptions.resolve(dims, self.schedule, self.microbatches)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at its peak, in bytes."""

    rank: int
    """Global rank (mesh order ``pp, dp, tp``; tp ranks hold the same amounts)."""
    pp_rank: int
    dp_rank: int
    parameters: int
    gradients: int
    """Gradient storage kept between steps."""
    optimizer: int
    """AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` tensors."""
    activations: int
    """Peak of saved activations and the step's transients (see :func:`activation_bytes`)."""
    communication: int
    """Gradient or parameter buffers alive only while reducing or gathering."""

    @property
    def total(self) -> int:
        """The peak: everything above at once."""
        return (
            self.parameters + self.gradients + self.optimizer + self.activations
            + self.communication
        )  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Every rank's memory under one layout (one rank per (pp, dp) position)."""

    config: TransformerConfig
    layout: Layout
    ranks: list[RankMemory]

    @property
    def peak(self) -> RankMemory:
        """The rank with the largest total."""
        return max(self.ranks, key=lambda r: r.total)

    def stage_peaks(self) -> list[RankMemory]:
        """Per pipeline stage, its rank with the largest total."""
        best: dict[int, RankMemory] = {}
        for rank in self.ranks:
            if rank.pp_rank not in best or rank.total > best[rank.pp_rank].total:
                best[rank.pp_rank] = rank
        return [best[p] for p in sorted(best)]


def estimate(config: TransformerConfig, layout: Layout) -> Estimate:
    """The memory of each (pp, dp) position's rank under ``layout``.

    Raises:
        ValueError: If ``config`` cannot train on ``layout`` (:meth:`Layout.check`).
    """
    layout.check(config)
    params = _model_params(_config_key(config), layout.lora_r, layout.lora_targets, layout.tp > 1)
    ranks = []
    for pp_rank in range(layout.pp):
        held = _stage_params(params, config, layout, pp_rank)
        states = _training_state(held, layout)
        act = activation_bytes(config, layout, pp_rank)
        comm = _communication_bytes(held, layout)
        for dp_rank, (p, g, o) in enumerate(states):
            rank = (pp_rank * layout.dp + dp_rank) * layout.tp
            ranks.append(RankMemory(rank, pp_rank, dp_rank, p, g, o, act, comm))
    return Estimate(config, layout, ranks)


def parse_bytes(text: str | int) -> int:
    """``80GiB``, ``80 GB``, ``1.5TiB`` or plain bytes -> bytes.

    Raises:
        ValueError: On anything else, naming the units understood.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"memory {text!r} is not a positive size; write e.g. 80GiB, 141GB or 85899345920"
        )
    return int(float(match.group(1)) * _UNITS[unit])


# ---- the model's parameters, as the strategies cut them ---------------------------------


@dataclass(frozen=True)
class _Param:
    """One parameter of the whole model (a tied weight once, with both places)."""

    index: int
    """Its place in ``named_parameters(remove_duplicate=False)``: the engine's order."""
    ident: int
    """The same for every name of one tied ``Parameter``."""
    name: str
    shape: tuple[int, ...]
    trainable: bool
    tp_dim: int | None
    """The dim tensor parallelism splits; None: replicated on every tp rank."""
    expert: bool
    """A stacked expert weight: expert parallelism splits its dim 0."""


def _config_key(config: TransformerConfig) -> tuple:
    """The config's field values (hashable: the config itself is not), for the cache."""
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


@functools.lru_cache(maxsize=16)
def _model_params(
    key: tuple, lora_r: int, lora_targets: tuple[str, ...], tensor_parallel: bool
) -> tuple[_Param, ...]:
    """The zoo model's parameters, built on the meta device, with LoRA put in as the LoRA
    callback does, and the dim the family's tensor-parallel plan splits each along (the
    plan is read, as the strategies read it, only with ``tensor_parallel``)."""
    from plugintrain.model_zoo import CausalLM, lora
    from plugintrain.strategies.expert_parallel import expert_layers
    from plugintrain.strategies.tensor_parallel import expand_plan

    config = _config_from_key(key)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        module = CausalLM(config)
        module.configure_model()  # draws the init seed from the forked generator
    if lora_r:
        lora.inject(module, lora.LoRASpec(r=lora_r, target_modules=lora_targets))
    styles = expand_plan(module, module.tp_plan(), False) if tensor_parallel else {}
    modules = dict(module.named_modules())
    experts = {f"{path}.experts" for path, _ in expert_layers(module)}
    idents: dict[int, int] = {}
    params = []
    for index, (name, param) in enumerate(module.named_parameters(remove_duplicate=False)):
        path, _, leaf = name.rpartition(".")
        dim = _tp_dim(modules[path], leaf, styles.get(path))
        ident = idents.setdefault(id(param), len(idents))
        shape, trains = tuple(param.shape), param.requires_grad
        params.append(_Param(index, ident, name, shape, trains, dim, path in experts))
    return tuple(params)


def _config_from_key(key: tuple) -> TransformerConfig:
    fields = dict(zip([f.name for f in dataclasses.fields(TransformerConfig)], key, strict=True))
    return TransformerConfig.from_dict(fields)


def _tp_dim(module: torch.nn.Module, leaf: str, style: str | None) -> int | None:
    """The dim of ``module.<leaf>`` that ``style`` splits (torch's Colwise/RowwiseParallel:
    a Linear's weight on dim 0 / 1, its bias on 0 / not at all; an embedding's rows), or
    what a layer with extra parameters (a LoRA adapter) declares."""
    from plugintrain.core.contracts import TensorParallelExtras

    kind = {"colwise": "colwise", "vocab_head": "colwise", "rowwise": "rowwise"}.get(style or "")
    if style == "vocab_embedding":
        return 0
    if kind is None:
        return None
    if isinstance(module, TensorParallelExtras) and leaf in module.tp_placements(kind):
        return module.tp_placements(kind)[leaf]
    if leaf == "bias":
        return 0 if kind == "colwise" else None
    return 0 if kind == "colwise" else 1


def _stage_of(name: str) -> int | str:
    """A parameter's place for the pipeline split: its block index, ``first`` or ``last``."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return int(match.group(1))
    first = name.startswith(("model.tok_embeddings.", "model.pos_embeddings."))
    return "first" if first else "last"


@dataclass(frozen=True)
class _Local:
    """One parameter as a rank holds it: duck-types what ``assign_buckets`` reads of a
    tensor, so the estimate buckets with the engine's own code (no tensor is made)."""

    size: int
    dtype: torch.dtype
    trainable: bool
    shape: tuple[int, ...]
    expert: bool = False
    """Reduced over the ranks holding the same experts (dp / ep of them), not over dp."""

    def numel(self) -> int:
        return self.size

    def element_size(self) -> int:
        return self.dtype.itemsize


def _stage_params(
    params: tuple[_Param, ...], config: TransformerConfig, layout: Layout, pp_rank: int
) -> list[_Local]:
    """The parameters pipeline rank ``pp_rank`` holds, in ``named_parameters`` order (a
    tied weight where it first appears on this rank), as one tp rank's shards."""
    from plugintrain.strategies.pipeline_stages import stage_layer_keys

    stages = layout.pp * layout.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.layers_per_stage)
    mine = [c * layout.pp + pp_rank for c in range(layout.vpp)]
    layers = {int(k) for s in mine for k in keys[s]}
    places = (
        layers | ({"first"} if 0 in mine else set()) | ({"last"} if stages - 1 in mine else set())
    )
    dtype = torch.bfloat16 if layout.precision == "bf16-true" else torch.float32
    held, seen = [], set()
    for p in params:
        if _stage_of(p.name) not in places or p.ident in seen:
            continue
        seen.add(p.ident)
        shape = list(p.shape)
        if p.tp_dim is not None:
            shape[p.tp_dim] //= layout.tp
        if p.expert:
            shape[0] //= layout.ep
        held.append(_Local(math.prod(shape), dtype, p.trainable, tuple(shape), p.expert))
    return held


# ---- parameters, gradients and optimizer state --------------------------------------------


def _training_state(held: list[_Local], layout: Layout) -> list[tuple[int, int, int]]:
    """Per dp rank: bytes of parameters, gradients and optimizer state kept between steps."""
    frozen = sum(p.size * p.element_size() for p in held if not p.trainable)
    trainable = [p for p in held if p.trainable]
    if layout.stage is None:
        grads = sum(p.size * p.element_size() for p in trainable)
        return [(frozen + grads, grads, _adam_bytes(trainable))]
    if layout.stage == 3:
        return [_fsdp_state(held, layout.dp)] * layout.dp
    return [(frozen + p, g, o) for p, g, o in _engine_state(trainable, layout.stage, layout)]


def _adam_bytes(params: list[_Local]) -> int:
    return sum(2 * p.size * p.element_size() + _STEP_BYTES for p in params)


def _engine_state(
    trainable: list[_Local], stage: int, layout: Layout
) -> list[tuple[int, int, int]]:
    """The gradient engine's flat buckets, for each rank of the dp group.

    Every rank holds each bucket's parameters, padded to a multiple of its group's size
    (dp; for expert weights the dp / ep ranks holding the same experts); its gradients
    whole at stage 0/1 and as the owned slice at stage 2; and AdamW state for the part of
    each parameter inside its owned slice (all of it at stage 0).
    """
    from plugintrain.strategies.buckets import assign_buckets, padded_numel

    params = grads = 0
    state = [0] * layout.dp
    groups = [p.expert for p in trainable]
    for indices in assign_buckets(trainable, layout.bucket_size_mb, groups) if trainable else []:
        members = [trainable[i] for i in indices]
        size, group = members[0].element_size(), _group_size(members[0], layout)
        padded = padded_numel(sum(p.size for p in members), group)
        params += padded * size
        grads += (padded // group if stage == 2 else padded) * size
        if stage == 0:
            owned = [_adam_bytes(members)] * group
        else:
            owned = _owned_state(members, padded // group, group)
        # The mesh flattens ("edp", "ep") into dp: dp rank r is rank r // ep of its group.
        stride = layout.ep if members[0].expert else 1
        state = [s + owned[rank // stride] for rank, s in enumerate(state)]
    return [(params, grads, s) for s in state]


def _group_size(param: _Local, layout: Layout) -> int:
    """The ranks ``param``'s gradient is reduced over: dp, or dp / ep for an expert weight."""
    return layout.dp // layout.ep if param.expert else layout.dp


def _owned_state(members: list[_Local], shard: int, dp: int) -> list[int]:
    """AdamW bytes on each of ``dp`` ranks for one bucket (in the engine's packing order)
    whose ranks own ``shard`` elements each: a rank steps the part of each parameter inside
    its range, as one tensor with its own ``step``."""
    state = [0] * dp
    offset = 0
    for p in members:
        end = offset + p.size
        for rank in range(offset // shard, (end - 1) // shard + 1):
            overlap = min(end, (rank + 1) * shard) - max(offset, rank * shard)
            state[rank] += 2 * overlap * p.element_size() + _STEP_BYTES
        offset = end
    return state


def _fsdp_state(held: list[_Local], dp: int) -> tuple[int, int, int]:
    """FSDP2: each parameter's dim 0 padded to a multiple of dp and split."""
    params = grads = state = 0
    for p in held:
        rows = p.shape[0] if p.shape else 1
        shard = math.ceil(rows / dp) * (p.size // max(rows, 1)) * p.element_size()
        params += shard
        if p.trainable:
            grads += shard
            state += 2 * shard + _STEP_BYTES
    return params, grads, state


# ---- activations ------------------------------------------------------------------------


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

    @classmethod
    def of(cls, config: TransformerConfig, layout: Layout) -> _Widths:
        tp = layout.tp
        low = 4 if layout.precision == "32-true" else 2
        return cls(
            d=config.n_embd,
            seq=1 / tp if layout.sp else 1.0,
            dq=config.n_head * config.head_dim // tp,
            dkv=config.kv_heads * config.head_dim // tp,
            heads=config.n_head // tp,
            kv_heads=config.kv_heads // tp,
            ffn=config.ffn_dim // tp,
            vocab=config.vocab_size // tp,
            res=2 if layout.precision == "bf16-true" else 4,
            act=low,
            mixed=layout.precision in ("bf16-mixed", "16-mixed"),
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
        tp_collectives = (2 * w.res * w.d * w.seq if layout.tp > 1 else 0) + (
            2 * w.res * w.d if layout.sp else 0
        )  # the rowwise outputs' reduction, the gathered inputs
        ffn = _moe_saved(config, w, matmuls_only=True) if sparse else w.act * linears_in[1] * w.ffn
        matmuls = w.dq + 2 * w.dkv + w.d + w.d
        return x + w.act * (matmuls + w.dq) + ffn + 4 * w.heads + tp_collectives
    norms = sum(_norm_saved(config, w, n) for n in linears_in)
    attention = w.act * (w.dq + 2 * w.dkv) + _qk_norm_saved(config, w)
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


def _weight_casts(params: tuple[_Param, ...], layout: Layout, places: set[int | str]) -> int:
    """Autocast's low-precision copy of each matmul weight of the blocks (or ``"last"``: the
    head) in ``places``, kept for backward by every forward (each pipeline micro-batch's
    forward casts anew); embedding lookups and norms cast nothing."""
    if layout.precision not in ("bf16-mixed", "16-mixed") or not places:
        return 0
    total = 0
    for p in params:
        lookup = p.name.startswith(("model.tok_embeddings.", "model.pos_embeddings."))
        if len(p.shape) == 2 and not lookup and _stage_of(p.name) in places:
            total += 2 * math.prod(p.shape) // (layout.tp if p.tp_dim is not None else 1)
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
    config: TransformerConfig, layout: Layout, stage: int, layers: list[int],
    params: tuple[_Param, ...],
) -> _Chunk:  # fmt: skip
    """The activations of virtual ``stage`` running ``layers`` for one micro-batch."""
    w = _Widths.of(config, layout)
    tokens = layout.micro_batch * layout.seq_len
    last = stage == layout.pp * layout.vpp - 1
    modes = {i: _recompute_mode(layout, i) for i in layers}
    kept = [i for i in layers if modes[i] == "none"]
    saved = tokens * sum(block_saved_bytes(config, layout, m, i) for i, m in modes.items())
    saved += _rope_tables(config, layout) if layers else 0
    saved += _weight_casts(params, layout, set(kept) | ({"last"} if last else set()))
    # Autocast's cache holds a recomputed block's casts until the forward ends.
    forward = _weight_casts(params, layout, set(layers) - set(kept))
    if stage == 0 and config.position == "learned":
        saved += 8 * layout.seq_len  # the positions (int64), kept by the embedding lookup
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
        head = _norm_saved(config, w, 1) + w.res * w.d * w.seq  # final norm and its input
        logits = tokens * w.vocab
        saved += tokens * head + 4 * logits  # log-softmax output (fp32)
        # The logits (and their fp32 copy) while the log-softmax runs.
        forward += logits * (4 if layout.precision == "32-true" else 6)
        # The fp32 gradients of log-probs and logits; later the blocks' backward, by when
        # the head's saved tensors are freed.
        backward = max(8 * logits, backward - tokens * head - 4 * logits)
    else:
        saved += tokens * w.res * w.d * w.seq  # the stage output, stashed for backward
    return _Chunk(saved, forward, backward)


def _recompute_mode(layout: Layout, index: int) -> str:
    if layout.recompute == "full" and index % layout.every_n_layers:
        return "none"
    return layout.recompute


def _rope_tables(config: TransformerConfig, layout: Layout) -> int:
    """The cosines and sines of the micro-batch's positions, gathered once per forward."""
    return 2 * 4 * layout.seq_len * config.head_dim if config.position == "rope" else 0


def activation_bytes(config: TransformerConfig, layout: Layout, pp_rank: int) -> int:
    """Peak activation bytes of pipeline rank ``pp_rank`` (each tp rank alike).

    Walks the rank's actions in its pipeline schedule (one forward and backward without a
    pipeline): a forward adds its chunk's saved activations, a backward frees them, and
    each action's own transients come on top of what is held then. Under autocast every
    micro-batch forward also keeps its cast of the chunk's weights. With a pipeline, one
    received input and one gradient buffer (the executor's wire tensors) are added.
    """
    from plugintrain.strategies.pipeline_stages import stage_layer_keys

    stages = layout.pp * layout.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.layers_per_stage)
    params = _model_params(_config_key(config), layout.lora_r, layout.lora_targets, layout.tp > 1)
    chunks = []
    for c in range(layout.vpp):
        stage = c * layout.pp + pp_rank
        chunks.append(_chunk(config, layout, stage, [int(k) for k in keys[stage]], params))
    peak = _schedule_peak(chunks, layout, pp_rank)
    if layout.pp > 1:
        w = _Widths.of(config, layout)
        peak += 2 * 4 * layout.micro_batch * layout.seq_len * w.d * w.seq
    return math.ceil(peak)


def _schedule_peak(chunks: list[_Chunk], layout: Layout, pp_rank: int) -> float:
    """The most this rank holds at any action of its schedule."""
    if layout.pp == 1:
        only = chunks[0]
        return only.saved + max(only.forward_extra, only.backward_extra)
    from plugintrain.strategies.pipeline_schedules import build_schedule

    name = layout.schedule or ("interleaved" if layout.vpp > 1 else "1f1b")
    schedule = build_schedule(name, layout.pp, layout.vpp, layout.num_microbatches)
    held = peak = 0.0
    for action in schedule.actions[pp_rank]:
        chunk = chunks[action.chunk]
        if action.kind == "F":
            held += chunk.saved
            peak = max(peak, held + chunk.forward_extra)
        else:
            peak = max(peak, held + chunk.backward_extra)
            held -= chunk.saved
    return peak


# ---- buffers of the reductions ----------------------------------------------------------


def _communication_bytes(held: list[_Local], layout: Layout) -> int:
    """Gradient (or parameter) storage alive only around a reduction (or gather).

    ZeRO-2 frees each bucket's full gradients once reduce-scattered, but the bucket being
    reduced and the one filling exist at once; a pipeline defers every reduction to the
    end of its schedule, so there the whole local gradient exists before it is scattered.
    FSDP2 gathers a block's parameters (the next one prefetched) and reduce-scatters its
    gradients; its root unit (embeddings, head) stays gathered through the step.
    """
    from plugintrain.strategies.buckets import assign_buckets, padded_numel

    trainable = [p for p in held if p.trainable]
    if layout.stage not in (2, 3) or not trainable:
        return 0
    if layout.stage == 3:
        root = sum(p.size * p.element_size() for p in held if len(p.shape) == 2)
        return root  # an upper bound: the blocks' units are smaller than the root's
    groups = [p.expert for p in trainable]
    sizes = sorted(
        padded_numel(
            sum(trainable[i].size for i in indices), _group_size(trainable[indices[0]], layout)
        )
        * trainable[indices[0]].element_size()
        for indices in assign_buckets(trainable, layout.bucket_size_mb, groups)
    )
    return sum(sizes) if layout.pp > 1 else sum(sizes[-2:])


# ---- layouts that fit -------------------------------------------------------------------


def candidate_layouts(config: TransformerConfig, gpus: int, base: Layout) -> Iterator[Layout]:
    """Every layout of up to ``gpus`` devices the model can train on, with ``base``'s
    batch, precision, recomputation and LoRA: dp x tp x pp over each device count, ZeRO 0-2
    (and FSDP2 without a pipeline) when dp > 1, sequence parallelism whenever tp > 1."""
    for world in range(1, gpus + 1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                stages = (0, 1, 2, 3) if dp > 1 and pp == 1 else (0, 1, 2) if dp > 1 else (0,)
                for zero in stages:
                    strategy = "single" if world == 1 else "hybrid"
                    layout = dataclasses.replace(
                        base, strategy=strategy, dp=dp, tp=tp, sp=tp > 1, pp=pp,
                        vpp=1, zero_stage=zero, microbatches=None, schedule=None,
                    )  # fmt: skip
                    try:
                        layout.check(config)
                    except ValueError:
                        continue
                    yield layout


def fitting_layouts(
    config: TransformerConfig, gpus: int, memory: int, base: Layout
) -> list[Estimate]:
    """The layouts of up to ``gpus`` devices whose largest rank needs at most ``memory``
    bytes, fewest devices first, then least memory per device."""
    fits = []
    for layout in candidate_layouts(config, gpus, base):
        result = estimate(config, layout)
        if result.peak.total <= memory:
            fits.append(result)
    return sorted(fits, key=lambda e: (e.layout.world_size, e.peak.total))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
