"""Dry runs: one CPU process plays rank R of N through torch's fake process-group backend.

Where :func:`~plugintrain.estimate.estimate` computes each rank's bytes from the model's
shapes, a dry run builds rank R as a launch would, on the real code path: the layout's
DeviceMesh over N ranks (``ParallelDims.build_mesh``), the model built shard-first on the
meta device, this rank's pipeline stages split off, the TP(+SP) plan, expert placement,
FSDP2 or the gradient engine's buckets and shards, the optimizer attached to them, then
one optimizer step whose state the optimizer creates itself. Nothing is allocated (every
tensor stays on the meta device) and no collective moves data (the ``fake`` backend
returns at once), so a rank of a 405B model on 1,024 ranks takes seconds and a few
hundred MB. The bytes reported are read from the tensors this rank holds, counted by
distinct storage as the real-rank tests count them
(``tests/distributed/test_estimate_distributed.py``).

What a real launch would refuse (a degree that does not divide, heads that tp does not
split, layers that do not split into the stages, experts that ep does not divide) is
refused here by the same checks, as one line naming the rank and the value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from plugintrain.core.memory import storage_bytes
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
    dp replicas at ZeRO stage 0 (the expert-data-parallel ones for an expert weight)."""
    full: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Each parameter's whole-model element count."""
    trace: StepTrace | None = None
    """The traced training step (``trace=True``)."""
    peak_rss: int = 0
    """The peak resident memory of the process that built this rank, in bytes."""


BACKEND = "plugintrain_dry_run"
"""torch's ``fake`` process group, registered for the meta device too (pipeline sends and
receives of meta tensors go through ``batch_isend_irecv``, which asks for the tensors'
device's backend)."""


def _register_backend() -> None:
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(
            BACKEND, _create_fake_pg, extended_api=True, devices=["cpu", "meta"]
        )


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as torch's ``fake`` backend, rank ``rank`` of
    ``world_size`` (collectives return at once, moving nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    _register_backend()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Traffic:
    """The collectives of one kind on one process group during a traced step."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
    ``send`` or ``recv``."""
    dim: str
    """The mesh dimension(s) of the group (``tp``, ``dp``, ``pp``, ``ep``, ``edp``, ``dp,tp``
    for FSDP2 over both, ``world``), or the peer for ``send`` and ``recv`` (``rank 64``)."""
    group_size: int
    count: int
    bytes: int
    """Their total size: each call's full buffer (an all-gather's output, a reduce-scatter's
    input), as nccl-tests count it."""


@dataclass(frozen=True)
class StepTrace:
    """One training step of a rank, run on meta tensors: what it computes and sends."""

    flops: int
    """Matmul and attention FLOPs (``torch.utils.flop_counter``), forward and backward
    (attention on meta tensors runs SDPA's math path: its matmuls count as ``aten.bmm``)."""
    flops_by_op: dict[str, int]
    """:attr:`flops` by operator."""
    activations: int
    """Peak bytes of the tensors the step creates (saved activations and transients)."""
    traffic: tuple[Traffic, ...]
    p2p: tuple[tuple[str, int, int], ...]
    """Every send and receive in order: (``send``/``recv``, peer global rank, bytes)."""


def dry_rank(config: TransformerConfig, layout: Layout, rank: int, trace: bool = False) -> DryRank:
    """Build global rank ``rank`` of ``layout`` on the meta device (see the module) and
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


def _build_rank(config: TransformerConfig, layout: Layout, rank: int, trace: bool) -> DryRank:
    from plugintrain.model_zoo import CausalLM
    from plugintrain.precision_plugins import precision_dtypes, precision_plugin_from_name
    from plugintrain.strategies.parallel_plan import check_model_fits, prepare_model

    dims = layout.dims
    mesh = dims.build_mesh("cpu")
    plugin = precision_plugin_from_name(layout.precision)
    dtypes = precision_dtypes(plugin)
    module = CausalLM(config)
    with torch.device("meta"), plugin.tensor_init_context():  # as the strategy builds it
        module.configure_model()
    if layout.lora is not None:
        _inject_lora(module, layout)
    batch = layout.micro_batch * (layout.pipeline.microbatches if dims.pp > 1 else 1)
    data = SimpleNamespace(seq_len=layout.seq_len, batch_size=batch)  # what a launch checks
    check_model_fits(module, dims, layout.pipeline, data, strategy_name="dry run")
    fsdp = dims.fsdp_enabled
    stages = prepare_model(
        module, dims, layout.pipeline, mesh, torch.device("meta"), True, layout.blocks,
        dtypes if fsdp else None,
    )  # fmt: skip
    engine, optimizer = _engine_and_optimizer(module, layout, dims, mesh, stages)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    traced = None
    if trace:
        traced = _traced_step(module, layout, plugin, mesh, stages, engine, optimizer, rank)
    else:
        _one_step(optimizer, stepped, engine)
    params = list(module.parameters())
    buckets = engine._layout.buckets if engine is not None else []
    engine_grads = [t for b in buckets for t in (b.grads, b.shard_grads, b.shard_pending)]
    grads = [p.grad for p in params + stepped] + engine_grads
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    coords = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names or ()
    where = dict(zip(names, coords, strict=True))
    dp_rank = _dp_rank(where, mesh)
    layers = tuple(
        name for name, _ in module.named_modules() if name.count(".") == 2 and ".layers." in name
    )
    owned, copies, full = _ownership(module, stepped, engine, dims)
    return DryRank(
        rank=rank, pp_rank=where.get("pp", 0), dp_rank=dp_rank, tp_rank=where.get("tp", 0),
        parameters=storage_bytes(params), gradients=storage_bytes(grads),
        optimizer=storage_bytes(states), layers=layers, owned=owned, copies=copies, full=full,
        trace=traced,
    )  # fmt: skip


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
    optimizer = module.optimizer(module._param_groups())
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
    experts = {
        id(p) for _, layer in expert_layers(module) for p in layer.experts.parameters()
    } if dims.ep > 1 else set()  # fmt: skip
    owned: dict[str, int] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for param in module.model.parameters():  # every trainable weight held: 0 until stepped
        if param.requires_grad:
            name = names[id(param)]
            owned[name] = 0
            replicas = dims.dp // dims.ep if id(param) in experts else dims.dp
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


def _traced_step(
    module: Any, layout: Layout, plugin: Any, mesh: Any, stages: Any, engine: Any,
    optimizer: torch.optim.Optimizer, rank: int,
) -> StepTrace:  # fmt: skip
    """One training step of this rank on meta inputs (zeros: every token id valid), as the
    strategy runs it: under the precision plugin's autocast, the vocabulary-parallel loss
    under tp, the pipeline schedule with pp > 1, the gradient engine's reductions, the
    optimizer step (and the engine's parameter all-gather after it)."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    from plugintrain.core.memory import LiveTensorMemory

    untraced(layout)  # not FSDP2: the plugin's autocast runs the forward, as it does then
    dims = layout.dims
    rows = layout.micro_batch * (layout.pipeline.microbatches if stages is not None else 1)
    tokens = torch.zeros(rows, layout.seq_len, dtype=torch.long, device="meta")
    recorder = _TrafficRecorder(mesh, rank)
    with LiveTensorMemory("meta") as memory, recorder, _local_flop_counter(display=False) as flops:
        memory.track(module.parameters(), module.buffers())
        if stages is not None:
            from plugintrain.strategies.pipeline_runtime import PipelineRuntime

            runtime = PipelineRuntime(module, stages, dims, layout.pipeline, mesh, plugin, rank)
            runtime.training_step((tokens, tokens), engine, 1)
            runtime.finish_gradients(engine)  # what the strategy's backward hook does
        else:
            with plugin.forward_context():
                loss = module.loss_fn(module(tokens), tokens)
            with loss_parallel() if dims.tp_enabled else nullcontext():
                loss.backward()
        # The step's transient peak, less what outlives it (the gradient buffers, counted
        # as gradients): the estimate's activations plus its reduction buffers.
        peak = memory.peak_bytes - memory.live_bytes
        optimizer.step()
    by_op = {str(op): n for op, n in flops.get_flop_counts().get("Global", {}).items()}
    return StepTrace(flops.get_total_flops(), by_op, peak, recorder.summary(), tuple(recorder.p2p))


def _local_share(args: Any) -> int:
    """How many ranks split an operator on DTensors: the product of the mesh dimensions
    over which any input is sharded (a column- or row-parallel matmul: tp; attention over
    sharded heads: tp; stacked experts: ep). 1 for plain tensors."""
    from torch.utils._pytree import tree_flatten

    split: dict[int, int] = {}
    for value in tree_flatten(args)[0]:
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            for dim, placement in enumerate(value.placements):
                if placement.is_shard():
                    split[dim] = mesh.size(dim)
    share = 1
    for size in split.values():
        share *= size
    return share


def _flop_counter_class() -> type:
    from torch.utils.flop_counter import FlopCounterMode

    class LocalFlopCounter(FlopCounterMode):
        """torch's FLOP counter, counting this rank's part of an operator on DTensors (it
        sees DTensor operators with their global shapes): divided by :func:`_local_share`."""

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if func_packet in self.flop_registry:
                count = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                count //= _local_share((args, kwargs))
                for parent in set(self.mod_tracker.parents):
                    self.flop_counts[parent][func_packet] += count
            return out

    return LocalFlopCounter


def _local_flop_counter(**kwargs: Any) -> Any:
    """A :func:`_flop_counter_class` instance (the class is made on first use)."""
    return _flop_counter_class()(**kwargs)


_DIST_CALLS = {  # torch.distributed: name -> (kind, the argument holding the whole buffer)
    "all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"), "gather": ("gather", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"), "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"), "irecv": ("recv", "tensor"),
}  # fmt: skip
_FUNCOL_CALLS = {  # functional collectives (what DTensor runs): name -> (kind, buffer arg)
    "all_reduce": ("all_reduce", "self"), "all_reduce_coalesced": ("all_reduce", "self"),
    "broadcast": ("broadcast", "self"),
    "all_gather_tensor": ("all_gather", "self"), "all_gather_single": ("all_gather", "self"),
    "all_gather_tensor_autograd": ("all_gather", "self"),
    "all_gather_into_tensor_coalesced": ("all_gather", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"),
    "reduce_scatter_single": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "self"),
    "all_to_all_single_autograd": ("all_to_all", "self"),
}  # fmt: skip


class _TrafficRecorder:
    """Every collective issued while it is entered, through ``torch.distributed`` or the
    functional collectives (which DTensor runs inside its own operators too), recorded
    once (a call made inside another recorded call is that call's): kind, group, size.

    Whole buffers, as nccl-tests count them: an all-gather's output (the functional one's
    input times the group), a reduce-scatter's input, every tensor of a list."""

    def __init__(self, mesh: Any, rank: int) -> None:
        self.rank = rank
        self.calls: dict[tuple[str, str, int], list[int]] = {}
        self.p2p: list[tuple[str, int, int]] = []
        self.dims = _mesh_groups(mesh, rank)
        self.world = dist.get_world_size()
        self._depth = 0
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _TrafficRecorder:
        import inspect

        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        for modules, table, functional in (
            ((dist, c10d), _DIST_CALLS, False),
            ((funcol,), _FUNCOL_CALLS, True),
        ):
            for name, (kind, buffer) in table.items():
                original = getattr(modules[0], name, None)
                if original is None:
                    continue
                wrapper = self._wrap(original, inspect.signature(original), kind, buffer,
                                     functional)  # fmt: skip
                for module in modules:
                    if getattr(module, name, None) is original:
                        self._patched.append((module, name, original))
                        setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched = []

    def _wrap(self, fn: Any, signature: Any, kind: str, buffer: str, functional: bool) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                with contextlib.suppress(TypeError):
                    bound = signature.bind(*args, **kwargs).arguments
                    self._record(kind, bound, buffer, functional)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return recorded

    def _record(self, kind: str, bound: dict[str, Any], buffer: str, functional: bool) -> None:
        group = bound.get("group")
        if functional:
            import torch.distributed._functional_collectives as funcol

            name = funcol._resolve_group_name(group, bound.get("tag", ""))
            group = dist.distributed_c10d._resolve_process_group(name)
        group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        nbytes = _tensor_bytes(bound.get(buffer))
        if functional and kind == "all_gather":
            nbytes *= size  # its input is this rank's part
        if kind in ("send", "recv"):
            peer = bound.get("dst" if kind == "send" else "src")
            if peer is None:  # a rank within the group
                local = bound.get("group_dst" if kind == "send" else "group_src")
                peer = dist.get_global_rank(group, local)
            self.p2p.append((kind, peer, nbytes))
            key = (kind, f"rank {peer}", size)
        else:
            ranks = frozenset(dist.get_process_group_ranks(group))
            dim = self.dims.get(ranks, "world" if size == self.world else f"{size} ranks")
            key = (kind, dim, size)
        entry = self.calls.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def summary(self) -> tuple[Traffic, ...]:
        return tuple(
            Traffic(op, dim, size, count, nbytes)
            for (op, dim, size), (count, nbytes) in sorted(self.calls.items())
        )


def _mesh_groups(mesh: Any, rank: int) -> dict[frozenset[int], str]:
    """The ranks of this rank's group along each mesh dimension and each pair of them
    (FSDP2 over ``dp,tp``; the flattened ``edp,ep`` = dp), read from the mesh's rank
    grid (no group is created) -> their names."""
    grid = mesh.mesh
    names = list(mesh.mesh_dim_names or ())
    where = (grid == rank).nonzero()
    if where.numel() == 0:
        return {}
    coords = where[0].tolist()
    groups: dict[frozenset[int], str] = {}
    for count in (1, 2):
        for picked in itertools.combinations(range(len(names)), count):
            index = tuple(slice(None) if d in picked else coords[d] for d in range(len(names)))
            ranks = frozenset(grid[index].flatten().tolist())
            groups.setdefault(ranks, ",".join(names[d] for d in picked))
    return groups


def untraced(layout: Layout) -> None:
    """Raise (one line) for a layout whose step cannot run on meta tensors yet."""
    if layout.dims.ep > 1:
        raise ValueError(
            "expert_parallel > 1 is not traced: the token exchange sizes depend on the routing"
            " of real data; leave out --trace (the bytes are still read)"
        )
    if layout.dims.fsdp_enabled:
        raise ValueError(
            "zero_stage 3 (FSDP2) is not traced: FSDP2 copies real data between its shards"
            " and buffers in a step; leave out --trace (the bytes are still read)"
        )


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested lists of them; a DTensor by
    its local shard)."""
    from torch.utils._pytree import tree_flatten

    return sum(
        _local(t).numel() * t.element_size()
        for t in tree_flatten(value)[0]
        if isinstance(t, Tensor)
    )


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _dp_rank(where: dict[str, int], mesh: Any) -> int:
    if "dp" in where:
        return where["dp"]
    if "edp" in where:  # expert parallelism: dp = edp x ep
        return where["edp"] * mesh["ep"].size() + where["ep"]
    return 0


def _inject_lora(module: Any, layout: Layout) -> None:
    from plugintrain.model_zoo.lora import inject

    assert layout.lora is not None
    inject(module.model, layout.lora)


def rank_of(layout: Layout, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
    """The global rank at mesh coordinates ``(pp, dp, tp)`` (tp innermost; with experts,
    ``dp = edp x ep`` flattened the same way)."""
    dims = layout.dims
    return (pp_rank * dims.dp + dp_rank) * dims.tp + tp_rank


def sample_ranks(layout: Layout) -> list[int]:
    """One rank of every kind: per pipeline stage, the first and last dp rank (ZeRO's
    padding lands on the last) and the first and last tp rank; every rank of a small
    layout."""
    dims = layout.dims
    picked = {
        rank_of(layout, pp, dp, tp)
        for pp in range(dims.pp)
        for dp in sorted({0, dims.dp - 1})
        for tp in sorted({0, dims.tp - 1})
    }
    return sorted(picked)


def ownership_problems(
    ranks: list[DryRank], layout: Layout, trainable: dict[str, int] | None = None
) -> list[str]:
    """Every trainable parameter's elements stepped exactly once per replica the layout
    keeps, over all ranks (call with every rank): one line per parameter that is not,
    or that no rank holds. ``trainable``: the whole model's trainable parameters (by
    canonical name) and the pipeline stages each belongs on (:func:`trainable_stages`);
    None: those the ranks hold, on the stages seen holding them."""
    if len(ranks) != layout.world_size:
        raise ValueError("the ownership check needs every rank (--ranks all)")
    stepped: dict[str, int] = {}
    stages: dict[str, set[int]] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for r in ranks:
        for name, n in r.owned.items():
            stepped[name] = stepped.get(name, 0) + n
            stages.setdefault(name, set()).add(r.pp_rank)
            copies[name], full[name] = r.copies[name], r.full[name]
    expected_stages = trainable or {name: len(held) for name, held in stages.items()}
    problems = [
        f"parameter {name}: held by no rank (nothing would train it)"
        for name in sorted(set(expected_stages) - set(stepped))
    ]
    for name in sorted(stepped):
        count = expected_stages.get(name, len(stages[name]))
        expected = full[name] * copies[name] * count
        if stepped[name] != expected:
            problems.append(
                f"parameter {name}: {stepped[name]} elements stepped over all ranks, expected"
                f" {expected} ({full[name]} x {copies[name]} replicas x {count} stages)"
            )
    return problems


def trainable_stages(config: TransformerConfig, layout: Layout) -> dict[str, int]:
    """The whole model's trainable parameters (canonical names; LoRA: its adapters) and
    how many pipeline stages hold each: two for a weight tied across the first and the
    last stage, else one (built on the meta device in this process)."""
    from plugintrain.model_zoo import CausalLM

    module = CausalLM(config)
    with torch.device("meta"):
        module.configure_model()
    if layout.lora is not None:
        _inject_lora(module, layout)
    tied = dict(module.model.tied_parameters())
    canonical = {b: a for a, b in tied.items()}
    stages = 2 if layout.dims.pp > 1 else 1
    names = {}
    for name, param in module.model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            name = canonical.get(name, name)
            names[name] = stages if name in tied else 1
    return names


def balance_problems(
    ranks: list[DryRank], config: TransformerConfig, layout: Layout, limit: float = 1.5
) -> list[str]:
    """A pipeline stage computing over ``limit`` x the training FLOPs per token of the
    lightest one (it sets the pace of every step; the layers it holds, as built, each
    ``6 x`` its active parameters plus its attention, and the head on the last stage):
    one line naming it and the fix."""
    per_stage = {r.pp_rank: _stage_flops(r, config, layout) for r in ranks}
    if len(per_stage) < 2:
        return []
    heavy = max(per_stage, key=per_stage.__getitem__)
    light = min(per_stage, key=per_stage.__getitem__)
    ratio = per_stage[heavy] / max(per_stage[light], 1)
    if ratio <= limit:
        return []
    return [
        f"pipeline stage {heavy} computes {ratio:.2f}x the FLOPs per token of stage {light}"
        f" ({per_stage[heavy]:.3g} vs {per_stage[light]:.3g}); move blocks off it with"
        " --layers_per_stage"
    ]


def _stage_flops(rank: DryRank, config: TransformerConfig, layout: Layout) -> float:
    """Training FLOPs per token of the blocks ``rank`` holds, plus the head on the last
    pipeline rank (:meth:`TransformerConfig.flops_per_token`'s terms, per layer)."""
    width = 2 * config.head_dim if config.mla is None else (
        config.mla.qk_head_dim + config.mla.v_head_dim)  # fmt: skip
    attention = 6 * config.n_head * width * layout.seq_len
    flops = 0.0
    for name in rank.layers:
        index = int(name.rsplit(".", 1)[1])
        flops += 6 * config._block_params(index, active=True) + attention
    if rank.pp_rank == layout.dims.pp - 1:
        flops += 6 * config.vocab_size * config.n_embd
    return flops


def build_ranks(
    config: TransformerConfig, layout: Layout, ranks: list[int], trace: bool = False,
    workers: int | None = None,
) -> list[DryRank]:  # fmt: skip
    """:func:`dry_rank` for each of ``ranks``, each in a process of its own (nothing a rank's
    world leaves behind, process groups and meshes, reaches the next, and no process's
    memory grows with the world), ``workers`` at a time (default: the CPU cores, at most 8).
    The processes are forked from a fork server that imported torch and the strategies
    once (never from this process, which may have threads).

    Raises:
        ValueError: The first rank's one-line error, in rank order (a rank that fails in
            another way, or whose process dies, too).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    workers = min(workers or min(8, os.cpu_count() or 1), len(ranks))
    context = multiprocessing.get_context("forkserver")
    _preload(context, PRELOAD)
    jobs = [(config, layout, r, trace) for r in ranks]
    try:
        with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
            results = list(pool.map(_rank_or_error, *zip(*jobs, strict=True), chunksize=1))
    except BrokenProcessPool:
        raise ValueError(
            "a dry-run rank's process died (out of memory?); run fewer at once with a"
            " smaller --ranks list"
        ) from None
    for result in results:
        if isinstance(result, str):
            raise ValueError(result)
    return results


PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.utils.flop_counter",
    "torch.testing._internal.distributed.fake_pg", "lightning.pytorch",
    "plugintrain.model_zoo.lm", "plugintrain.strategies.hybrid",
    "plugintrain.strategies.parallel_plan", "plugintrain.strategies.pipeline_runtime",
    "plugintrain.precision_plugins", "plugintrain.core.memory", "plugintrain.estimate.search",
    "plugintrain.estimate.dry_run",
]  # fmt: skip
"""What the fork server imports once, so that no rank's process imports it again."""


def _preload(context: Any, modules: list[str]) -> None:
    """Add ``modules`` to what the fork server imports when it starts (keeping what this
    process asked for before; nothing once it runs). Only a speed-up: skipped if this
    Python's fork server keeps its state elsewhere."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    asked = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    context.set_forkserver_preload(list(dict.fromkeys([*asked, *modules])))


def _rank_or_error(
    config: TransformerConfig, layout: Layout, rank: int, trace: bool
) -> DryRank | str:
    """A worker's :func:`dry_rank` (with its process's peak RSS); its error as one line
    (sent back as a string): a launch's refusal as it is, anything else with its type."""
    import resource

    try:
        built = dry_rank(config, layout, rank, trace)
    except ValueError as error:
        return str(error)
    except Exception as error:  # a kernel or DTensor rule the meta device lacks
        text = str(error).splitlines()[0][:300] if str(error) else ""
        return f"rank {rank}: {type(error).__name__}: {text} (the dry run cannot build it)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dataclasses.replace(built, peak_rss=rss)


def parse_ranks(text: str, layout: Layout) -> list[int]:
    """``--ranks``: ``sample`` (:func:`sample_ranks`), ``all``, or comma-separated ranks."""
    if text == "all":
        return list(range(layout.world_size))
    if text == "sample":
        return sample_ranks(layout)
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--ranks={text!r}: give sample, all or ranks like 0,5,1023") from None
    bad = [r for r in ranks if not 0 <= r < layout.world_size]
    if bad:
        raise ValueError(
            f"--ranks={text!r}: rank {bad[0]} is not in 0..{layout.world_size - 1}"
            f" (world size {layout.world_size})"
        )
    return ranks


@dataclass
class DryRunReport:
    """A dry run's ranks, the estimate's figures for them, and the problems found."""

    ranks: list[DryRank]
    estimated: dict[int, tuple[int, int, int, int]]
    """Rank -> the estimate's parameters, gradients, optimizer and total bytes."""
    seconds: float
    peak_rss: int
    problems: list[str]

    def totals(self, r: DryRank) -> int:
        """A rank's dry-run training state plus the estimate's activations and buffers."""
        est = self.estimated[r.rank]
        return r.parameters + r.gradients + r.optimizer + est[3] - sum(est[:3])

    def table(self, size: Any) -> str:
        """Ranks with the same figures on one row, with their count and stages."""
        rows: dict[tuple, list[DryRank]] = {}  # by the figures shown (padding bytes apart)
        for r in self.ranks:
            held = (r.parameters, r.gradients, r.optimizer)
            shown = tuple(size(n) for n in (*held, self.totals(r)))
            rows.setdefault((*shown, held == self.estimated[r.rank][:3]), []).append(r)
        lines = [
            f"dry run of {len(self.ranks)} of {self.world_size} ranks (fake process group,"
            f" meta tensors): {self.seconds:.1f} s, peak RSS {size(self.peak_rss)}",
            "",
            f"{'ranks':>6}  {'stages':<14}{'parameters':>12}{'gradients':>12}{'optimizer':>12}"
            f"{'total':>12}  estimate",
        ]
        for (params, grads, opt, total, same), members in rows.items():
            stages = sorted({m.pp_rank for m in members})
            named = ",".join(map(str, stages)) if len(stages) <= 4 else f"{len(stages)} stages"
            lines.append(
                f"{len(members):>6}  {named:<14}{params:>12}{grads:>12}{opt:>12}{total:>12}"
                f"  {'equal' if same else 'DIFFERS'}"
            )
        lines += self._traffic_lines(size)
        lines.append("")
        lines.append(f"problems: {len(self.problems) or 'none'}")
        return "\n".join(lines)

    def _traffic_lines(self, size: Any) -> list[str]:
        """With traces: per pipeline stage (its first traced rank), the step's FLOPs,
        activation peak and collectives per mesh dimension."""
        lines: list[str] = []
        seen: set[int] = set()
        for r in self.ranks:
            if r.trace is None or r.pp_rank in seen:
                continue
            seen.add(r.pp_rank)
            t = r.trace
            lines += [
                "",
                f"rank {r.rank} (stage {r.pp_rank}), one step: {t.flops / 1e12:.4g} TFLOP,"
                f" activations (peak, beyond what persists) {size(t.activations)}",
            ]
            for c in t.traffic:
                lines.append(
                    f"  {c.op:<15}{c.dim:<10}{c.group_size:>6} ranks {c.count:>6} calls"
                    f"  {size(c.bytes):>11}"
                )
        return lines

    world_size: int = 0

    def as_json(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        return {
            "world_size": self.world_size, "seconds": self.seconds, "peak_rss": self.peak_rss,
            "problems": self.problems,
            "ranks": [
                {"rank": r.rank, "pp_rank": r.pp_rank, "dp_rank": r.dp_rank,
                 "tp_rank": r.tp_rank, "parameters": r.parameters, "gradients": r.gradients,
                 "optimizer": r.optimizer, "total": self.totals(r),
                 "estimate": dict(zip(("parameters", "gradients", "optimizer", "total"),
                                      self.estimated[r.rank], strict=True)),
                 "trace": None if r.trace is None else {
                     "flops": r.trace.flops, "flops_by_op": r.trace.flops_by_op,
                     "activations": r.trace.activations,
                     "traffic": [dataclasses.asdict(c) for c in r.trace.traffic],
                     "p2p": [list(m) for m in r.trace.p2p]}}
                for r in self.ranks
            ],
        }  # fmt: skip


def p2p_problems(ranks: list[DryRank]) -> list[str]:
    """Every point-to-point message between two traced ranks paired: rank a's n-th send to
    b has the size of b's n-th receive from a, and their counts agree (a send with no
    receive blocks a NCCL pipeline for good). One line per pair that does not."""
    traced = {r.rank: r.trace for r in ranks if r.trace is not None}
    sent: dict[tuple[int, int], list[int]] = {}
    received: dict[tuple[int, int], list[int]] = {}
    for rank, trace in traced.items():
        for kind, peer, nbytes in trace.p2p:
            if kind == "send":
                sent.setdefault((rank, peer), []).append(nbytes)
            else:
                received.setdefault((peer, rank), []).append(nbytes)
    problems = []
    for pair in sorted(set(sent) | set(received)):
        src, dst = pair
        if src not in traced or dst not in traced:
            continue
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        if sends != recvs:
            problems.append(
                f"rank {src} -> rank {dst}: {len(sends)} sends of {sorted(set(sends))} bytes,"
                f" {len(recvs)} receives of {sorted(set(recvs))} bytes; the pipeline would hang"
            )
    return problems


def dry_run(
    config: TransformerConfig,
    layout: Layout,
    ranks: list[int],
    memory: int | None = None,
    trace: bool = False,
) -> DryRunReport:
    """:func:`dry_rank` for each of ``ranks``, against the layout's
    :func:`~plugintrain.estimate.estimate`, with the problems found: a rank whose bytes
    differ from the estimate's, one over ``memory``, an unbalanced pipeline, and with every
    rank a parameter not stepped exactly once per replica."""
    import resource
    import time

    if trace:
        untraced(layout)
    start = time.monotonic()
    built = build_ranks(config, layout, ranks, trace)  # a rank's error names the rank
    seconds = time.monotonic() - start
    from plugintrain.estimate.search import estimate

    expected = estimate(config, layout)
    by_position = {(e.pp_rank, e.dp_rank): e for e in expected.ranks}
    estimated = {}
    for r in built:
        e = by_position[(r.pp_rank, r.dp_rank)]
        estimated[r.rank] = (e.parameters, e.gradients, e.optimizer, e.total)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = max([own, *(r.peak_rss for r in built)])  # this process's and each rank's
    report = DryRunReport(built, estimated, seconds, rss, [], layout.world_size)
    problems = report.problems
    for r in built:
        held = (r.parameters, r.gradients, r.optimizer)
        if held != estimated[r.rank][:3]:
            problems.append(
                f"rank {r.rank}: holds parameters/gradients/optimizer {held} bytes, the"
                f" estimate says {estimated[r.rank][:3]}"
            )
        if memory is not None and report.totals(r) > memory:
            problems.append(
                f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}, tp {r.tp_rank}) needs"
                f" {report.totals(r)} bytes > --memory {memory}; list layouts that fit with"
                f" --fit {memory}"
            )
    problems += balance_problems(built, config, layout)
    problems += p2p_problems(built)
    if len(built) == layout.world_size:
        problems += ownership_problems(built, layout, trainable_stages(config, layout))
    return report
