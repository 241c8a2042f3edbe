"""Tracing one training step of a dry-run rank on meta tensors: the FLOPs it computes (this
rank's part of each operator), the peak of the tensors it creates, and every collective it
issues, by mesh dimension, with each point-to-point message in order."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.estimate.layout import Layout


@dataclass(frozen=True)
class Traffic:
    """The collectives of one kind on one process group during a traced step."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
    ``send`` or ``recv``."""
    dim: str
    """The mesh dimension(s) of the group (``tp``, ``dp``, ``pp``, ``ep``, ``edp``, ``cp``,
    ``dp,tp`` for FSDP2 over both, ``dp,cp`` for the gradients under cp, ``world``), or the
    peer for ``send`` and ``recv`` (``rank 64``)."""
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


def traced_step(
    module: Any,
    layout: Layout,
    plugin: Any,
    mesh: Any,
    stages: Any,
    engine: Any,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> StepTrace:
    """One training step of this rank on meta inputs (zeros: every token id valid), as the
    strategy runs it: under the precision plugin's autocast, the vocabulary-parallel loss
    under tp, the pipeline schedule with pp > 1, the gradient engine's reductions, the
    optimizer step (and the engine's parameter all-gather after it)."""
    untraced(layout)  # not FSDP2: the plugin's autocast runs the forward, as it does then
    dims = layout.dims
    rows = layout.micro_batch * (layout.pipeline.microbatches if stages is not None else 1)
    tokens = torch.zeros(rows, layout.seq_len, dtype=torch.long, device="meta")
    recorder = TrafficRecorder(mesh, rank)
    with LiveTensorMemory("meta") as memory, recorder, LocalFlopCounter(display=False) as flops:
        memory.track(module.parameters(), module.buffers())
        if stages is not None:
            from plugintrain.strategies.pipeline_runtime import PipelineRuntime

            runtime = PipelineRuntime(module, stages, dims, layout.pipeline, mesh, plugin, rank)
            runtime.training_step((tokens, tokens), engine, 1)
            runtime.finish_gradients(engine)  # what the strategy's backward hook does
        else:
            with plugin.forward_context():
                loss = module.loss_fn(module(tokens), tokens)
            with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
                loss.backward()
        # The step's transient peak, less what outlives it (the gradient buffers, counted
        # as gradients): the estimate's activations plus its reduction buffers.
        peak = memory.peak_bytes - memory.live_bytes
        optimizer.step()
    by_op = {str(op): n for op, n in flops.get_flop_counts().get("Global", {}).items()}
    return StepTrace(flops.get_total_flops(), by_op, peak, recorder.summary(), tuple(recorder.p2p))


class LocalFlopCounter(FlopCounterMode):
    """torch's FLOP counter, counting this rank's part of an operator on DTensors (it sees
    DTensor operators with their global shapes): divided by :func:`_local_share`."""

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if func_packet in self.flop_registry:
            count = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            count //= _local_share((args, kwargs))
            for parent in set(self.mod_tracker.parents):
                self.flop_counts[parent][func_packet] += count
        return out


def _local_share(args: Any) -> int:
    """How many ranks split an operator on DTensors: the product of the mesh dimensions
    over which any input is sharded (a column- or row-parallel matmul: tp; attention over
    sharded heads: tp; stacked experts: ep). 1 for plain tensors."""
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


_DIST_CALLS = {  # torch.distributed: name -> (kind, the argument holding the whole buffer)
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "gather": ("gather", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}
_FUNCOL_CALLS = {  # functional collectives (what DTensor runs): name -> (kind, buffer arg)
    "all_reduce": ("all_reduce", "self"),
    "all_reduce_coalesced": ("all_reduce", "self"),
    "broadcast": ("broadcast", "self"),
    "all_gather_tensor": ("all_gather", "self"),
    "all_gather_single": ("all_gather", "self"),
    "all_gather_tensor_autograd": ("all_gather", "self"),
    "all_gather_into_tensor_coalesced": ("all_gather", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"),
    "reduce_scatter_single": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "self"),
    "all_to_all_single_autograd": ("all_to_all", "self"),
}


class TrafficRecorder:
    """Every collective issued while it is entered, through ``torch.distributed`` or the
    functional collectives (which DTensor runs inside its own operators too), recorded
    once (a call made inside another recorded call is that call's): kind, group, size.

    Whole buffers, as nccl-tests count them: an all-gather's output (the functional one's
    input times the group), a reduce-scatter's input, every tensor of a list."""

    def __init__(self, mesh: Any, rank: int) -> None:
        self.rank = rank
        self.calls: dict[tuple[str, str, int], list[int]] = {}
        self.p2p: list[tuple[str, int, int]] = []
        """Every send and receive in order: (``send``/``recv``, peer global rank, bytes)."""
        self.dims = _mesh_groups(mesh, rank)
        self.world = dist.get_world_size()
        self._depth = 0
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> TrafficRecorder:
        for modules, table, functional in (
            ((dist, c10d), _DIST_CALLS, False),
            ((funcol,), _FUNCOL_CALLS, True),
        ):
            for name, (kind, buffer) in table.items():
                original = getattr(modules[0], name, None)
                if original is None:
                    continue
                wrapper = self._wrap(original, kind, buffer, functional)
                for module in modules:
                    if getattr(module, name, None) is original:
                        self._patched.append((module, name, original))
                        setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched = []

    def summary(self) -> tuple[Traffic, ...]:
        """The calls recorded, one :class:`Traffic` per kind and group."""
        return tuple(
            Traffic(op, dim, size, count, nbytes)
            for (op, dim, size), (count, nbytes) in sorted(self.calls.items())
        )

    def _wrap(self, fn: Any, kind: str, buffer: str, functional: bool) -> Any:
        signature = inspect.signature(fn)

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
            name = funcol._resolve_group_name(group, bound.get("tag", ""))
            group = c10d._resolve_process_group(name)
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


def _mesh_groups(mesh: Any, rank: int) -> dict[frozenset[int], str]:
    """The ranks of this rank's group along each mesh dimension and each pair and triple
    of them (FSDP2 over ``dp,tp``; the flattened ``edp,ep`` = dp; gradients over ``dp,cp``
    or ``edp,ep,cp`` under context parallelism, experts' over ``edp,cp``), read from the
    mesh's rank grid (no group is created) -> their names (the fewest dimensions first: with
    dp 1 the dp x cp group is ``cp``)."""
    grid = mesh.mesh
    names = list(mesh.mesh_dim_names or ())
    where = (grid == rank).nonzero()
    if where.numel() == 0:
        return {}
    coords = where[0].tolist()
    groups: dict[frozenset[int], str] = {}
    for count in (1, 2, 3):
        for picked in itertools.combinations(range(len(names)), count):
            index = tuple(slice(None) if d in picked else coords[d] for d in range(len(names)))
            ranks = frozenset(grid[index].flatten().tolist())
            groups.setdefault(ranks, ",".join(names[d] for d in picked))
    return groups


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested lists of them; a DTensor by
    its local shard)."""
    return sum(
        _local(t).numel() * t.element_size()
        for t in tree_flatten(value)[0]
        if isinstance(t, Tensor)
    )


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
