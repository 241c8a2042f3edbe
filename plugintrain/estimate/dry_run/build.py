"""Building one rank of a dry run as a launch would, on the meta device: what it holds after
its first optimizer step, and which elements of each parameter its optimizer steps."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from plugintrain.core.memory import storage_bytes
from plugintrain.estimate.dry_run.trace import StepTrace, traced_step
from plugintrain.estimate.dry_run.world import fake_world
from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig


@dataclass(frozen=True)
class DryRank:
    """What one rank of a dry run holds after its first optimizer step, in bytes."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    parameters: int
    """The distinct storages behind this rank's parameters (a DTensor by its local shard;
    the gradient engine's flat, padded buckets)."""
    gradients: int
    """Gradient storage kept between steps (the engine's buckets or shards; ``.grad``)."""
    optimizer: int
    """The optimizer's state tensors after one step."""
    layers: tuple[str, ...]
    """The transformer blocks this rank holds (its pipeline stages')."""
    owned: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Elements of each whole-model parameter (by its canonical name: a tied head by the
    embedding's) that this rank's optimizer steps."""
    copies: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """How many ranks may step the same elements of each parameter held here, besides
    pipeline stages holding a tied weight: the tp ranks holding the same piece, times the
    dp x cp ranks at ZeRO stage 0 (edp x cp for an expert weight)."""
    full: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Each parameter's whole-model element count."""
    trace: StepTrace | None = None
    """The traced training step (``trace=True``)."""
    peak_rss: int = 0
    """The peak resident memory of the process that built this rank, in bytes."""
    cp_rank: int = 0
    """Its rank in its context-parallel group."""

    @property
    def training_state(self) -> tuple[int, int, int]:
        """Parameters, gradients and optimizer state: what persists between steps (as the
        estimate's :attr:`~plugintrain.estimate.RankMemory.training_state`)."""
        return self.parameters, self.gradients, self.optimizer

    @property
    def block_indices(self) -> list[int]:
        """The indices of :attr:`layers` in the whole model."""
        return [int(name.rsplit(".", 1)[1]) for name in self.layers]


def dry_rank(config: TransformerConfig, layout: Layout, rank: int, trace: bool = False) -> DryRank:
    """Build global rank ``rank`` of ``layout`` on the meta device (see the package) and
    take one optimizer step (with ``trace``, a whole training step: forward, backward,
    reductions, the pipeline schedule, the step, in :attr:`DryRank.trace`); what it holds.

    Raises:
        ValueError: One line naming the rank and the value, where a launch would fail.
    """
    with fake_world(rank, layout.world_size):
        try:
            return _build_rank(config, layout, rank, trace)
        except ValueError as error:
            raise ValueError(f"rank {rank}: {error}") from None


def meta_model(config: TransformerConfig, layout: Layout, plugin: Any = None) -> Any:
    """The whole :class:`~plugintrain.model_zoo.CausalLM` on the meta device (under
    ``plugin``'s ``tensor_init_context``, as the strategy builds it), with the layout's
    LoRA adapters."""
    from plugintrain.model_zoo import CausalLM
    from plugintrain.model_zoo.lora import inject

    module = CausalLM(config)
    init = plugin.tensor_init_context() if plugin is not None else contextlib.nullcontext()
    with torch.device("meta"), init:
        module.configure_model()
    if layout.lora is not None:
        inject(module.model, layout.lora)
    return module


def _build_rank(config: TransformerConfig, layout: Layout, rank: int, trace: bool) -> DryRank:
    from plugintrain.precision_plugins import precision_dtypes, precision_plugin_from_name
    from plugintrain.strategies.parallel_plan import check_model_fits, prepare_model

    dims = layout.dims
    mesh = dims.build_mesh("cpu")
    plugin = precision_plugin_from_name(layout.precision)
    module = meta_model(config, layout, plugin)
    batch = layout.micro_batch * (layout.pipeline.microbatches if dims.pp > 1 else 1)
    data = SimpleNamespace(seq_len=layout.seq_len, batch_size=batch)  # what a launch checks
    check_model_fits(module, dims, layout.pipeline, data, strategy_name="dry run")
    dtypes = precision_dtypes(plugin) if dims.fsdp_enabled else None
    meta = torch.device("meta")
    stages = prepare_model(module, dims, layout.pipeline, mesh, meta, True, layout.blocks, dtypes)
    engine, optimizer = _engine_and_optimizer(module, layout, dims, mesh, stages)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    traced = None
    if trace:
        traced = traced_step(module, layout, plugin, mesh, stages, engine, optimizer, rank)
    else:
        _one_step(optimizer, stepped, engine)
    params = list(module.parameters())
    grads = [p.grad for p in params + stepped]
    grads += engine.gradient_buffers() if engine is not None else []
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    where = dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or [], strict=True))
    layers = tuple(
        name for name, _ in module.named_modules() if name.count(".") == 2 and ".layers." in name
    )
    owned, copies, full = _ownership(module, stepped, engine, dims)
    return DryRank(
        rank=rank,
        pp_rank=where.get("pp", 0),
        dp_rank=_dp_rank(where, mesh),
        tp_rank=where.get("tp", 0),
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads),
        optimizer=storage_bytes(states),
        layers=layers,
        owned=owned,
        copies=copies,
        full=full,
        trace=traced,
        cp_rank=where.get("cp", 0),
    )


def _engine_and_optimizer(
    module: Any, layout: Layout, dims: Any, mesh: Any, stages: Any
) -> tuple[Any, torch.optim.Optimizer]:
    """The gradient engine as the strategy builds it (a pipeline rank's chunks in buckets
    of their own; none under FSDP2 or on one device) and the module's own optimizer class
    on its parameter groups, attached to the engine's shards."""
    from plugintrain.strategies.parallel_plan import build_engine
    from plugintrain.strategies.pipeline_runtime import chunk_partition
    from plugintrain.strategies.tied import TiedParameters

    engine = None
    if layout.stage is not None:
        tied = TiedParameters.of(module)
        partition = chunk_partition(module, stages, tied) if stages is not None else None
        engine = build_engine(module, dims, mesh, layout.bucket_size_mb, True, False, partition)
    optimizer = module.optimizer(module.param_groups())
    if engine is not None:
        engine.attach(optimizer)
    return engine, optimizer


def _ownership(
    module: Any, stepped: list[Tensor], engine: Any, dims: Any
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """:attr:`DryRank.owned`, :attr:`DryRank.copies` and :attr:`DryRank.full`."""
    from plugintrain.strategies.expert_parallel import expert_layers
    from plugintrain.strategies.parallel_plan import tp_replicas

    canonical = {b: a for a, b in module.model.tied_parameters()}
    names: dict[int, str] = {}
    for name, param in module.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), canonical.get(name, name))
    experts: set[int] = set()
    if dims.ep > 1:
        experts = {id(p) for _, layer in expert_layers(module) for p in layer.experts.parameters()}
    owned: dict[str, int] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for param in module.model.parameters():  # every trainable weight held: 0 until stepped
        if param.requires_grad:
            name = names[id(param)]
            owned[name] = 0
            replicas = (dims.dp // dims.ep if id(param) in experts else dims.dp) * dims.cp
            copies[name] = tp_replicas(param, dims.tp) * (replicas if dims.zero_stage == 0 else 1)
            full[name] = param.numel()
    for shard in stepped:
        param = engine.parameter_of(shard) if engine is not None else shard
        local = shard._local_tensor if isinstance(shard, DTensor) else shard
        owned[names[id(param)]] += local.numel()
    return owned, copies, full


def _one_step(optimizer: torch.optim.Optimizer, stepped: list[Tensor], engine: Any) -> None:
    """The optimizer's first step, which creates its state as a real step does. With the
    engine, its own end of backward: every bucket reduced (a gradient that never arrived
    counts as zero), the owned slices published as the shards' ``.grad``; without, a
    ``.grad`` of each parameter's shape (what backward leaves, and Lightning keeps)."""
    if engine is not None:
        engine.finish_grad_sync()
    else:
        for p in stepped:
            p.grad = torch.zeros_like(p)
    optimizer.step()


def _dp_rank(where: dict[str, int], mesh: Any) -> int:
    if "dp" in where:
        return where["dp"]
    if "edp" in where:  # expert parallelism: dp = edp x ep
        return where["edp"] * mesh["ep"].size() + where["ep"]
    return 0
