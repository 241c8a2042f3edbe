"""Apply parallelism to a model from outside, in torchtitan's order.

As torchtitan's ``models/llama3/infra/parallelize.py`` does for Llama, these free functions
apply to any module, in a fixed order: the tensor (+ sequence) parallel plan on
``mesh["tp"]`` (:mod:`~plugintrain.strategies.tensor_parallel`), the experts of
mixture-of-experts layers over ``mesh["ep"]`` (:mod:`~plugintrain.strategies.expert_parallel`),
recomputation and compile of each block (:mod:`~plugintrain.strategies.blocks`), then FSDP2
``fully_shard`` for ZeRO-3 or our :class:`~plugintrain.strategies.GradientEngine` on the dp
group for ZeRO 0-2. The functions beside them describe the result: how many tp ranks hold
each piece (:func:`tp_replicas`) and the world's gradient layout
(:func:`hybrid_gradient_layout`) that precision plugins clip and check found-inf by.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from plugintrain.core.context_shard import ContextShard
from plugintrain.core.contracts import (
    GradientLayout,
    GradientPiece,
    ParallelModule,
    SplitsSequences,
    check_contract,
    default_gradient_layout,
)
from plugintrain.precision_plugins import PrecisionDtypes
from plugintrain.strategies.blocks import BlockOptions, transformer_blocks
from plugintrain.strategies.expert_parallel import expert_reduce_groups, parallelize_experts
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.mesh import ParallelDims, data_parallel_mesh
from plugintrain.strategies.pipeline_runtime import check_pipeline, split_stages
from plugintrain.strategies.pipeline_stages import PipelineOptions, VirtualStage
from plugintrain.strategies.tensor_parallel import (
    apply_tensor_parallel,
    retie,
    shared_parameters,
    vocab_parallel_loss,
)


def parallelize(
    module: nn.Module,
    plan: dict[str, str] | None,
    dims: ParallelDims,
    mesh: DeviceMesh,
    bucket_size_mb: float = 25.0,
    overlap_comm: bool = True,
    blocks: BlockOptions | None = None,
    dtypes: PrecisionDtypes | None = None,
) -> GradientEngine | None:
    """Apply TP(+SP), recomputation and compile, then data parallelism, to ``module`` in place.

    Args:
        module: The model (or the LightningModule holding it); ``plan`` paths are relative
            to it.
        plan: Module path pattern -> style name; None or empty when ``tensor_parallel == 1``.
        dims: The degrees.
        mesh: The mesh built by :meth:`ParallelDims.build_mesh`.
        bucket_size_mb: Gradient bucket size of the engine (ZeRO stage 0/1/2).
        overlap_comm: Reduce buckets during backward (ZeRO stage 0/1/2).
        blocks: Recomputation and compile of the transformer blocks; None: neither.
        dtypes: The training dtypes, for FSDP2's mixed precision (see :func:`shard_model`).

    Returns:
        The gradient engine for ZeRO stage 0/1/2 (attach the optimizer to it); None for
        FSDP2 (stage 3), whose optimizer steps the module's own sharded parameters.
    """
    if blocks is not None:
        blocks.check(module, built=True)
        blocks.check_tensor_parallel(dims.tensor_parallel, dims.sequence_parallel)
    shard_model(module, plan, dims, mesh, blocks=blocks, dtypes=dtypes)
    compiled = blocks is not None and blocks.compile
    return build_engine(module, dims, mesh, bucket_size_mb, overlap_comm, compiled)


def shard_model(
    module: nn.Module,
    plan: dict[str, str] | None,
    dims: ParallelDims,
    mesh: DeviceMesh,
    fully_shard_dp: bool = True,
    blocks: BlockOptions | None = None,
    dtypes: PrecisionDtypes | None = None,
) -> None:
    """The module-rewriting part of :func:`parallelize`: TP(+SP), expert parallelism,
    recomputation and compile, then FSDP2 for stage 3.

    Args:
        module: As in :func:`parallelize`; with pipeline parallelism, this rank's split
            model (plan entries for modules it does not hold are skipped).
        plan: As in :func:`parallelize`.
        dims: The degrees.
        mesh: The mesh built by :meth:`ParallelDims.build_mesh`.
        fully_shard_dp: Apply FSDP2 when ``zero_stage == 3`` (False for evaluation).
        blocks: Recomputation and compile of the transformer blocks; None: neither.
        dtypes: The training dtypes. Under mixed precision FSDP2 gathers parameters in
            the compute dtype and reduce-scatters gradients in fp32
            (:func:`fsdp_mixed_precision`), so the forward needs no autocast; None: fp32.
    """
    if dims.tp_enabled:
        if not plan:
            raise ValueError(
                f"tensor_parallel={dims.tensor_parallel} needs a tensor-parallel plan, but"
                f" {type(module).__name__} declares none (a `tp_plan()` method)."
            )
        apply_tensor_parallel(
            module,
            plan,
            mesh["tp"],
            dims.sequence_parallel,
            allow_missing=dims.pipeline_parallel > 1,
        )
    parallelize_experts(module, dims, mesh)
    if blocks is not None:
        blocks.apply(module)
    if dims.fsdp_enabled and fully_shard_dp:
        _fully_shard(module, data_parallel_mesh(mesh), fsdp_mixed_precision(dtypes))


def prepare_model(
    module: Any,
    dims: ParallelDims,
    options: PipelineOptions,
    mesh: DeviceMesh,
    device: torch.device,
    fitting: bool,
    blocks: BlockOptions | None = None,
    dtypes: PrecisionDtypes | None = None,
) -> list[VirtualStage] | None:
    """Lay ``module`` out for this rank before Lightning moves it and builds optimizers.

    torchtitan's order: split the pipeline stages (keeping this rank's), apply TP(+SP),
    recomputation and compile (``blocks``), then FSDP2 for ZeRO-3 when fitting (in the
    precision's ``dtypes``, see :func:`shard_model`); then
    allocate and initialize what this rank kept if the module was built on the meta device
    (:func:`materialize`), and make the loss vocabulary-parallel under tp. The gradient
    engine comes later (:func:`build_engine`).

    Returns:
        This rank's virtual stages when pp > 1, else None.
    """
    pipelined = dims.pipeline_parallel > 1
    stages = split_stages(module, dims, options, mesh) if pipelined else None
    plan = module.tp_plan() if dims.tp_enabled else None
    shard_model(module, plan, dims, mesh, fully_shard_dp=fitting, blocks=blocks, dtypes=dtypes)
    materialize(module, device)
    if dims.cp_enabled:
        cp = mesh["cp"]
        module.split_sequences(ContextShard(dims.cp, cp.get_local_rank(), cp.get_group()))
    if dims.tp_enabled:
        module.loss_fn = vocab_parallel_loss(module.loss_fn)
    return stages


def builds_on_meta(module: Any) -> bool:
    """Whether ``module`` can be built on the meta device and initialized shard by shard:
    it implements :class:`~plugintrain.core.contracts.ShardFirstModule`. Asked before
    ``configure_model``, so ``init_seed`` counts as a class attribute (``CausalLM``'s
    property, whose value exists only once the model is built) or an instance one."""
    has_seed = hasattr(type(module), "init_seed") or "init_seed" in vars(module)
    return callable(getattr(type(module), "init_weights", None)) and has_seed


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate this rank's part of a module built on the meta device (after the pipeline
    split and sharding) on ``device`` and initialize it with ``module.init_weights()``.

    Allocates nothing beyond what the rank keeps, plus the initializer's one chunk at a
    time. A module with no meta tensors is left as it is, and one without ``init_weights``
    to Lightning (which calls each submodule's ``reset_parameters``). ``device`` meta (a
    dry run, :mod:`plugintrain.estimate.dry_run`) keeps the rank's part on meta, unallocated.
    """
    tensors = itertools.chain(module.parameters(), module.buffers())
    if not callable(getattr(module, "init_weights", None)) or not any(t.is_meta for t in tensors):
        return
    if device.type == "meta":
        return
    if hasattr(module, "init_seed") and dist.is_initialized():  # rank 0's weights everywhere
        seed = [module.init_seed]
        dist.broadcast_object_list(seed, src=0)
        module.init_seed = seed[0]
    shared = shared_parameters(module)
    # `to_empty`, but only for what is on meta: `to_empty` itself would also replace the
    # real states of the module's metrics (torchmetrics applies it to them, defaults and
    # all) with uninitialized memory. Through `_apply`, as `to_empty` goes, so that FSDP2
    # modules still re-register their shards. Replaces each parameter: re-tie the shared.
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    retie(shared)
    module.init_weights()


def check_model_fits(
    module: Any,
    dims: ParallelDims,
    options: PipelineOptions,
    datamodule: Any = None,
    strategy_name: str = "HybridParallelStrategy",
) -> None:
    """Raise if ``module`` (and the data's ``seq_len`` and ``batch_size``) cannot run on
    ``dims``; needs no process group, so it runs before any process is launched.

    With tp > 1 or pp > 1 the module must implement
    :class:`~plugintrain.core.contracts.ParallelModule`; heads, kv-heads, MLP width and
    vocabulary must divide by tp, and the sequence length too with sequence parallelism;
    with pp > 1 the layers must split into pp x vpp stages and the batch into
    ``microbatches``; with ep > 1 the model must have mixture-of-experts layers whose
    routed experts ep divides (:meth:`~plugintrain.strategies.mesh.ParallelDims.
    validate_experts`). Data parallelism alone takes any module.
    """
    pp, ep = dims.pipeline_parallel, dims.expert_parallel
    if not (dims.tp_enabled or pp > 1 or dims.ep_enabled or dims.cp_enabled):
        return
    experts = f", expert_parallel={ep}" if dims.ep_enabled else ""
    experts += f", context_parallel={dims.cp}" if dims.cp_enabled else ""
    layout = f"tensor_parallel={dims.tensor_parallel}, pipeline_parallel={pp}{experts}"
    needed_by = f"{strategy_name}({layout})"
    check_contract(module, ParallelModule, needed_by)
    if dims.cp_enabled:
        check_contract(module, SplitsSequences, needed_by)
    dims.validate_model(module.config, getattr(datamodule, "seq_len", None))
    if pp > 1:
        check_pipeline(module.config, dims, options, getattr(datamodule, "batch_size", None))


def build_engine(
    module: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    bucket_size_mb: float = 25.0,
    overlap_comm: bool = True,
    compiled: bool = False,
    partition: Mapping[str, Hashable] | None = None,
) -> GradientEngine | None:
    """Our gradient engine on the dp group for ZeRO stage 0/1/2 (expert weights reduced over
    their ``edp`` group); None for stage 3.

    Build it last: ``Module.to()`` re-sets the ``.data`` of DTensor parameters, after which
    their gradient hooks no longer fire. ``compiled``: the blocks are compiled (see
    :class:`~plugintrain.strategies.GradientEngine`); ``partition``: keeps a pipeline
    rank's chunks in buckets of their own (see
    :func:`~plugintrain.strategies.pipeline_runtime.chunk_partition`).
    """
    if dims.fsdp_enabled:
        return None
    return GradientEngine(
        module.named_parameters(),
        process_group=data_parallel_mesh(mesh).get_group(),
        stage=dims.zero_stage,
        bucket_size_mb=bucket_size_mb,
        overlap_comm=overlap_comm,
        compiled=compiled,
        reduce_groups=expert_reduce_groups(module, mesh),
        partition=partition,
    )


def fsdp_mixed_precision(dtypes: PrecisionDtypes | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for mixed precision (torchtitan's): parameters all-gathered in the
    compute dtype, gradients reduce-scattered in fp32 into the fp32 shards, which the
    optimizer steps as master weights. None when weights and compute share a dtype."""
    if dtypes is None or not dtypes.mixed:
        return None
    return MixedPrecisionPolicy(param_dtype=dtypes.compute, reduce_dtype=torch.float32)


def _fully_shard(
    module: nn.Module, dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy | None
) -> None:
    kwargs = {} if policy is None else {"mp_policy": policy}
    # Transformer blocks are the FSDP2 units (one all-gather per block), as in torchtitan.
    for _, block in transformer_blocks(module):
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(module, mesh=dp_mesh, **kwargs)  # the rest: embeddings, final norm, (tied) head


def tp_replicas(param: Tensor, tp: int) -> int:
    """How many tp ranks hold the same local piece of ``param``."""
    if not isinstance(param, DTensor):
        return tp
    mesh, placements = param.device_mesh, param.placements
    names = mesh.mesh_dim_names or ()
    shards = math.prod(
        mesh.size(i) for i, p in enumerate(placements) if p.is_shard() and names[i] == "tp"
    )
    return tp // shards


def hybrid_gradient_layout(
    parameters: Iterable[Tensor],
    engine: GradientEngine | None,
    tensor_parallel: int,
    stage_replicated: Iterable[Tensor] = (),
) -> GradientLayout:
    """The layout of the gradients an optimizer steps, over the whole pp x tp x dp world.

    With the engine, a shard's gradient is replicated over the dp group at stage 0 (an
    expert weight's over its ``edp`` group; once at stage 1/2) and over the tp ranks that
    hold the same piece of its parameter; FSDP2
    gradients are DTensors on the 2-D mesh, which the default layout counts directly.
    Pipeline stages hold different parameters, except ``stage_replicated`` ones (an
    embedding tied to the head, held by the first and the last stage), counted twice.

    Args:
        parameters: The parameters an optimizer steps.
        engine: The gradient engine (ZeRO stage 0/1/2), or None (FSDP2).
        tensor_parallel: The tp degree.
        stage_replicated: Model parameters held by two pipeline stages.
    """
    if engine is None:
        return default_gradient_layout(parameters)
    params = [p for p in parameters if p.grad is not None]
    local = engine.gradient_layout(params)
    twice = {id(p) for p in stage_replicated}
    pieces = []
    for piece, p in zip(local.pieces, params, strict=True):
        param = engine.parameter_of(p)
        stages = 2 if id(param) in twice else 1
        pieces.append(
            GradientPiece(piece.grad, piece.replicas * tp_replicas(param, tensor_parallel) * stages)
        )
    return GradientLayout(group=dist.group.WORLD, pieces=pieces, device=local.device)
