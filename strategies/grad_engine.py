"""A data-parallel gradient engine: bucketed, overlapped reduction with ZeRO-1/2 sharding.

Stages follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC'20), §5:

- ``0``: every rank all-reduces gradients and steps the whole model (classic DP).
- ``1`` (P_os): gradients are all-reduced, but each rank keeps optimizer state for, and
  steps, only its 1/N slice of every bucket; updated slices are then all-gathered.
- ``2`` (P_os+g): gradients are reduce-scattered, so each rank also keeps only its 1/N
  gradient slice.
- ``"parameter_server"``: gradients are reduced to rank 0, which alone holds optimizer
  state and steps; the parameters are broadcast back.

The memory layout is Megatron-LM's distributed optimizer (Shoeybi et al.; ``megatron/core/
distributed/param_and_grad_buffer.py``): parameters are views into flat per-bucket
buffers padded to a multiple of the group size, so rank ``r`` owns the contiguous range
``[r * S, (r + 1) * S)`` of each bucket. The optimizer steps "shard parameters", one view
of the owned range per original parameter (so weight-decay groups survive), and keeps
being the user's optimizer object (so LR schedulers keep working).

The engine knows nothing about Lightning: it runs on any process group, so a hybrid
strategy can run it on the ``dp`` sub-mesh's group. Some parameters may be reduced over a
group of their own (``reduce_groups``: under expert parallelism, each expert's weights
over the ranks holding that expert): buckets are formed per group, and each bucket
reduces, shards (ZeRO-1/2) and syncs over its group, while every gradient is averaged
by the data-parallel degree.

Collectives are launched in one fixed order, the same on every rank, as NCCL needs (a
rank that launched bucket 2 before bucket 1 while its peers did the reverse would hang
or silently add the wrong buffers): a bucket whose gradients are all in launches itself
and the complete buckets after it only once every earlier bucket has launched; the rest
launch at the end of backward, in bucket order. A parameter that gets no gradient on a
rank (unused in that rank's forward) therefore counts as a zero gradient there, as with
DDP's ``find_unused_parameters=True``: its bucket and the ones after it wait for the end
of that rank's backward, and every rank still joins the same collectives in the same
order.

Gradients that a tensor-parallel layer leaves ``Partial`` over tp (a replicated
sequence-parallel norm weight, a mixture-of-experts layer run on a sequence shard) are
accumulated as they are and summed over tp once per step, after the data-parallel
reduction, on the slice each rank owns (summing over tp and over dp commute), instead of
an all-reduce inside every gradient hook of every micro-batch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from plugintrain.core import profiling
from plugintrain.core.contracts import GradientLayout, GradientPiece

PARAMETER_SERVER: Final = "parameter_server"
Stage: TypeAlias = Literal[0, 1, 2, "parameter_server"]
STAGES: Final[tuple[Stage, ...]] = (0, 1, 2, PARAMETER_SERVER)

# ZeRO-2 completes a bucket's reduce-scatter (and frees its full gradients) before it
# starts the next one's, so during backward a rank holds its 1/N shard plus two full
# buckets: the one on the network and the one filling. The earlier reduce-scatter had the
# whole time of filling the next bucket to finish, so backward rarely waits.
MAX_FULL_BUCKETS_IN_FLIGHT: Final = 1

# Optimizers whose update of an element reads only that element's gradient and state, so
# stepping slices on different ranks equals stepping the whole tensor on one.
ELEMENTWISE_OPTIMIZERS: set[type[Optimizer]] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
}


def register_elementwise_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Allow the engine to shard ``cls`` (usable as a class decorator).

    Only register optimizers that update each element from its own gradient and state;
    norm-based (LAMB, LARS) or factored (Adafactor) updates would silently change.
    """
    ELEMENTWISE_OPTIMIZERS.add(cls)
    return cls


def check_shardable(optimizer: Optimizer) -> None:
    """Raise a ``TypeError`` naming the fix if ``optimizer`` cannot be stepped in slices."""
    if isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS)):
        return
    allowed = ", ".join(sorted(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS))
    raise TypeError(
        f"{type(optimizer).__name__} cannot be used with the data-parallel gradient engine: it"
        " steps each parameter as flat slices owned by different ranks, which is exact only for"
        f" elementwise optimizers ({allowed}). Use one of those, or register an elementwise"
        " optimizer with `plugintrain.strategies.register_elementwise_optimizer`."
    )


def validate_engine_args(stage: Any, bucket_size_mb: float) -> None:
    """Fail early, quoting the offending value, on an unknown stage or bucket size."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"`stage` must be one of {STAGES}, got {stage!r}. Stage 3 (parameter"
            " partitioning) is not implemented here; use FSDP2 for it."
        )
    if not bucket_size_mb > 0:
        raise ValueError(f"`bucket_size_mb` must be > 0, got {bucket_size_mb}.")


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``, so shards are equal."""
    return math.ceil(numel / world_size) * world_size


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous ``[lo, hi)`` range of a padded flat buffer that ``rank`` owns."""
    size = padded_numel(numel, world_size) // world_size
    return rank * size, (rank + 1) * size


def assign_buckets(
    params: list[Tensor], bucket_size_mb: float, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Group parameter indices into buckets of about ``bucket_size_mb`` whose parameters share
    a dtype (and ``groups[i]``, their reduction group, when given).

    Parameters are taken in reverse, the order backward produces their gradients (as torch
    DDP does), so the first bucket fills first and its reduction overlaps the rest of
    backward. A bucket closes once it reaches the size, or before a parameter that would
    take it past the size: one parameter never splits, and one larger than the size sits
    alone (its bucket then adopts its storage instead of copying it).
    """
    limit = bucket_size_mb * 2**20
    buckets: list[list[int]] = []
    open_by_kind: dict[tuple[Hashable, torch.dtype], tuple[list[int], int]] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        nbytes = _local(param).numel() * param.element_size()
        kind = (None if groups is None else groups[index], param.dtype)
        indices, size = open_by_kind.get(kind, ([], 0))
        if indices and size + nbytes > limit:
            indices, size = [], 0
        if not indices:
            buckets.append(indices)
        indices.append(index)
        size += nbytes
        open_by_kind[kind] = ([], 0) if size >= limit else (indices, size)
    return buckets


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes held by the tensors of ``optimizer.state`` on this rank."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )


@dataclass(eq=False)
class _BucketEntry:
    """One parameter's place in its bucket (and the optimizer's shard of it, if owned)."""

    name: str
    param: Tensor
    bucket: _Bucket
    offset: int
    numel: int
    shard: nn.Parameter | None = None
    shard_offset: int = 0
    partial_groups: tuple[dist.ProcessGroup, ...] = ()
    """The groups the accumulated gradient is still to be summed over (its ``Partial`` tp
    dims, see :func:`_local_grad`); empty for a gradient that arrives whole."""

    def shard_of(self, full: Tensor) -> Tensor:
        """The part of a full, parameter-shaped tensor that this rank's shard covers."""
        assert self.shard is not None
        start = self.shard_offset - self.offset
        return full.reshape(-1)[start : start + self.shard.numel()]


@dataclass(eq=False)
class _Bucket:
    """A flat parameter buffer, its gradient buffer and the rank's owned range."""

    params: Tensor
    owned: tuple[int, int]
    scheme: _AllReduce
    """How the bucket is reduced and synced, over which group."""
    entries: list[_BucketEntry] = field(default_factory=list)
    grads: Tensor | None = None
    shard_grads: Tensor | None = None
    """Stage 2: the owned slice of the reduced gradient, summed over the step's passes."""
    shard_fresh: bool = True
    """Stage 2: nothing has been reduced into ``shard_grads`` in this step yet."""
    shard_pending: Tensor | None = None
    """Stage 2: a later pass's reduce-scatter output, added to ``shard_grads`` when done."""
    stale: bool = False
    grads_arrived: int = 0
    """How many of the bucket's parameters got their gradient in this backward pass."""
    launched: bool = False
    """Whether this pass's collective has been started."""
    work: dist.Work | None = None

    @property
    def complete(self) -> bool:
        """Whether every parameter of the bucket got its gradient in this backward pass."""
        return self.grads_arrived == len(self.entries)

    def grad_buffer(self) -> Tensor:
        """The flat gradient buffer, zeroed on first use after the last reduction.

        Zeroing lazily keeps the reduced gradients readable until the optimizer stepped.
        """
        if self.grads is None:
            self.grads = torch.zeros_like(self.params)
        elif self.stale:
            self.grads.zero_()
        self.stale = False
        return self.grads


def is_elementwise(value: Any, numel: int) -> bool:
    """Whether optimizer state ``value`` has one element per parameter element (``exp_avg``),
    as opposed to a scalar such as ``step``: only the former is sliced between ranks."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


@dataclass
class _StateMeta:
    """One parameter's optimizer state, described: scalars by value, elementwise tensors
    by ``(key, dtype)`` (their values stay sharded until gathered)."""

    scalars: dict[str, Any] = field(default_factory=dict)
    sharded: set[tuple[str, torch.dtype]] = field(default_factory=set)

    @classmethod
    def of(cls, values: dict[str, Any], numel: int) -> _StateMeta:
        """Describe ``values``, the state of a shard of ``numel`` elements, with scalar
        tensors copied to the host (see :func:`host_scalar`)."""
        meta = cls()
        for key, value in values.items():
            if is_elementwise(value, numel):
                meta.sharded.add((key, value.dtype))
            else:
                meta.scalars[key] = host_scalar(value)
        return meta


def host_scalar(value: Any) -> Any:
    """``value`` with a tensor moved to the CPU (a copy; other values as they are).

    Fused or capturable AdamW keeps ``step`` as a scalar tensor on the parameter's GPU.
    Pickled through an object collective, it would be unpickled onto that same ``cuda:k``
    on every other rank (creating a CUDA context on a GPU that is not theirs) and saved as
    a ``cuda:k`` tensor in the checkpoint; the optimizer's ``load_state_dict`` moves it
    back to each parameter's device.
    """
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


class _AllReduce:
    """Stage 0: every rank reduces and owns everything."""

    # Each rank's optimizer holds the same gradient, so it counts once per world in norms.
    replicated = True
    # The profiling ranges (plugintrain.core.profiling) of waiting for a bucket's collectives.
    reduce_phase: str = profiling.GRAD_ALL_REDUCE
    sync_phase: str = profiling.PARAM_ALL_GATHER

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.root = dist.get_global_rank(group or dist.group.WORLD, 0)

    @property
    def frees_grads(self) -> bool:
        """Whether the full gradient buffer is dropped once reduced."""
        return False

    @property
    def reduces_each_pass(self) -> bool:
        """Whether gradient accumulation communicates on every backward pass (ZeRO-2: the
        full gradients of a pass are reduce-scattered into the shard and freed, as in
        DeepSpeed) instead of accumulating whole gradients locally until the last pass."""
        return False

    def after_reduce(self, bucket: _Bucket) -> None:
        """Runs once the bucket's collective has completed."""

    def owned(self, numel: int) -> tuple[int, int]:
        return 0, numel

    def reduce(self, bucket: _Bucket) -> dist.Work:
        return dist.all_reduce(bucket.grad_buffer(), group=self.group, async_op=True)

    def reduced_grads(self, bucket: _Bucket) -> Tensor:
        assert bucket.grads is not None
        lo, hi = bucket.owned
        return bucket.grads[lo:hi]

    def sync_params(self, bucket: _Bucket) -> dist.Work | None:
        return None

    def gather_to_root(self, owned: Tensor) -> Tensor | None:
        """A full flat buffer from each rank's owned piece, on group rank 0 only."""
        return owned if self.rank == 0 else None


class _ShardedOptimizer(_AllReduce):
    """Stage 1: all-reduced gradients, optimizer state for the owned 1/N slice only."""

    replicated = False

    def owned(self, numel: int) -> tuple[int, int]:
        return shard_range(numel, self.rank, self.world_size)

    def sync_params(self, bucket: _Bucket) -> dist.Work | None:
        lo, hi = bucket.owned
        # In-place all-gather: the owned slice is already at its place in the output.
        return dist.all_gather_single(bucket.params, bucket.params[lo:hi], self.group, True)

    def gather_to_root(self, owned: Tensor) -> Tensor | None:
        pieces = [torch.empty_like(owned) for _ in range(self.world_size)]
        dist.gather(owned, pieces if self.rank == 0 else None, dst=self.root, group=self.group)
        return torch.cat(pieces) if self.rank == 0 else None


class _ShardedGradients(_ShardedOptimizer):
    """Stage 2: reduce-scatter, so only the owned gradient slice outlives the reduction."""

    reduce_phase = profiling.GRAD_REDUCE_SCATTER

    @property
    def frees_grads(self) -> bool:
        return True

    @property
    def reduces_each_pass(self) -> bool:
        return True

    def reduce(self, bucket: _Bucket) -> dist.Work:
        assert bucket.shard_grads is not None
        if bucket.shard_fresh:  # the step's first pass writes the shard directly
            out, bucket.shard_fresh = bucket.shard_grads, False
        else:
            out = bucket.shard_pending = torch.empty_like(bucket.shard_grads)
        return dist.reduce_scatter_single(
            out, bucket.grad_buffer(), group=self.group, async_op=True
        )

    def after_reduce(self, bucket: _Bucket) -> None:
        assert bucket.shard_grads is not None
        if bucket.shard_pending is not None:
            bucket.shard_grads.add_(bucket.shard_pending)
            bucket.shard_pending = None
        bucket.grads = None  # the pass's full gradients now live in the shard

    def reduced_grads(self, bucket: _Bucket) -> Tensor:
        assert bucket.shard_grads is not None
        return bucket.shard_grads


class _ParameterServer(_AllReduce):
    """Gradients reduced to rank 0, which alone steps; parameters broadcast back."""

    replicated = False
    reduce_phase = profiling.GRAD_REDUCE
    sync_phase = profiling.PARAM_BROADCAST

    @property
    def frees_grads(self) -> bool:
        return self.rank != 0

    def owned(self, numel: int) -> tuple[int, int]:
        return (0, numel) if self.rank == 0 else (0, 0)

    def reduce(self, bucket: _Bucket) -> dist.Work:
        return dist.reduce(bucket.grad_buffer(), dst=self.root, group=self.group, async_op=True)

    def sync_params(self, bucket: _Bucket) -> dist.Work | None:
        return dist.broadcast(bucket.params, src=self.root, group=self.group, async_op=True)


_SCHEMES: dict[Stage, type[_AllReduce]] = {
    0: _AllReduce,
    1: _ShardedOptimizer,
    2: _ShardedGradients,
    PARAMETER_SERVER: _ParameterServer,
}


def _pack_bucket(
    named: list[tuple[str, Tensor]], scheme: _AllReduce, compiled: bool = False
) -> _Bucket:
    """Move the parameters' data into one flat buffer (the ``Parameter`` objects stay, their
    ``.data`` becomes a view) and make this rank's shard parameters of the owned range.
    With ``compiled``, DTensor local shards get storages of their own (see
    :class:`GradientEngine`)."""
    numel = sum(_local(param).numel() for _, param in named)
    first = _local(named[0][1])
    padded = padded_numel(numel, scheme.world_size)
    if len(named) == 1 and padded == numel and first.is_contiguous():
        flat = first.detach().view(-1)  # adopt its storage: no second copy of a big tensor
    else:
        flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    bucket = _Bucket(params=flat, owned=scheme.owned(flat.numel()), scheme=scheme)
    offset = 0
    for name, param in named:
        local = _local(param)
        view = flat[offset : offset + local.numel()]
        if view.data_ptr() != local.data_ptr():
            view.copy_(local.detach().reshape(-1))
        _rebind(param, view.view_as(local), compiled)
        bucket.entries.append(_make_entry(name, param, bucket, offset))
        offset += local.numel()
    if scheme.frees_grads and bucket.owned[1] > bucket.owned[0]:
        bucket.shard_grads = torch.zeros(
            bucket.owned[1] - bucket.owned[0], dtype=flat.dtype, device=flat.device
        )
    return bucket


def _make_entry(name: str, param: Tensor, bucket: _Bucket, offset: int) -> _BucketEntry:
    numel = _local(param).numel()
    entry = _BucketEntry(name, param, bucket, offset, numel)
    lo = max(offset, bucket.owned[0])
    hi = min(offset + numel, bucket.owned[1])
    if lo < hi:
        entry.shard = nn.Parameter(bucket.params[lo:hi])
        entry.shard_offset = lo
    return entry


def _broadcast_params(buckets: list[_Bucket]) -> None:
    """Start every replica from its group's rank 0's weights, as torch DDP does."""
    works = [
        dist.broadcast(b.params, src=b.scheme.root, group=b.scheme.group, async_op=True)
        for b in buckets
    ]
    for work in works:
        work.wait()


class _Reductions:
    """The collectives of a backward pass, bucket by bucket, launched in bucket order.

    Every rank of a group must start the same collectives in the same order, so buckets
    that become complete launch only once every earlier bucket has launched
    (:meth:`launch_ready`); :meth:`drain` launches the rest in order. ZeRO-2 frees each
    bucket's full gradients once reduced; completing the previous bucket's collective
    before starting the next bounds how many exist at once (the backpressure DeepSpeed's
    buckets apply).
    """

    def __init__(self, buckets: list[_Bucket], divisor: int) -> None:
        self.buckets = buckets
        self.divisor = divisor
        """What every summed gradient is divided by: the data-parallel degree."""
        self.in_flight: deque[_Bucket] = deque()
        self.next = 0
        """Index of the first bucket not launched in this pass (all before it are)."""

    def launch(self, bucket: _Bucket) -> None:
        """Start ``bucket``'s collective (after completing older ones, under ZeRO-2)."""
        bounded = bucket.scheme.reduces_each_pass
        while bounded and len(self.in_flight) >= MAX_FULL_BUCKETS_IN_FLIGHT:
            self._complete(self.in_flight.popleft())
        bucket.work, bucket.launched = bucket.scheme.reduce(bucket), True
        self.in_flight.append(bucket)

    def launch_ready(self) -> None:
        """Launch the complete buckets that follow the launched ones, in bucket order; stop
        at the first incomplete bucket (it launches once complete, or at :meth:`drain`)."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if not bucket.launched:
                if not bucket.complete:
                    return
                self.launch(bucket)
            self.next += 1

    def launch_holding(self, wanted: set[int]) -> None:
        """Launch, in bucket order, the buckets holding parameters whose ``id`` is in
        ``wanted`` (see :meth:`GradientEngine.launch`)."""
        for bucket in self.buckets:
            held = [id(entry.param) in wanted for entry in bucket.entries]
            if bucket.launched or not any(held):
                continue
            if not all(held):
                foreign = bucket.entries[held.index(False)].name
                raise ValueError(
                    f"Cannot reduce a bucket early that also holds {foreign!r}; give the"
                    " engine a `partition` that puts it in a bucket of its own."
                )
            self.launch(bucket)

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.work is not None
        with profiling.record(bucket.scheme.reduce_phase):
            bucket.work.wait()
        bucket.work = None
        bucket.scheme.after_reduce(bucket)

    def drain(self) -> None:
        """Start the buckets not started in this pass (in bucket order, the same on every
        rank) and wait for all of them."""
        for bucket in self.buckets:
            if not bucket.launched:
                self.launch(bucket)
        while self.in_flight:
            self._complete(self.in_flight.popleft())
        for bucket in self.buckets:
            bucket.launched, bucket.grads_arrived = False, 0
        self.next = 0

    def publish(self, bucket: _Bucket) -> None:
        """Sum partial gradients over tp, average the reduced owned slice and point the shard
        parameters' ``.grad`` at it.

        A bucket reduced over a smaller group (an expert's holders) is divided by the
        data-parallel degree all the same: each holder's gradient already sums the tokens
        its expert-parallel peers sent it, so the group's sum covers every replica's batch.
        """
        reduced = bucket.scheme.reduced_grads(bucket)
        _sum_partial_grads(bucket, reduced)
        reduced.div_(self.divisor)
        lo = bucket.owned[0]
        for entry in bucket.entries:
            if entry.shard is not None:
                start = entry.shard_offset - lo
                entry.shard.grad = reduced[start : start + entry.shard.numel()]
        if bucket.scheme.frees_grads:
            bucket.grads = None  # ZeRO-2: already freed; parameter server: not the root's
        bucket.stale, bucket.shard_fresh = True, True


def _sum_partial_grads(bucket: _Bucket, reduced: Tensor) -> None:
    """Sum the owned part of each ``Partial`` entry's reduced gradient over its tp groups,
    one all-reduce per group for the whole bucket.

    The dp reduction has summed the ranks' partial gradients already, and summing over tp
    commutes with it, so only the owned slice (1/dp of it at ZeRO-1/2) is summed. Every
    tp peer holds the same buckets and owned range (they share their dp rank), so all of
    them join the same collectives in bucket order.
    """
    lo, hi = bucket.owned
    pieces: dict[tuple[dist.ProcessGroup, ...], list[Tensor]] = {}
    for entry in bucket.entries:
        start, end = max(entry.offset, lo), min(entry.offset + entry.numel, hi)
        if entry.partial_groups and start < end:
            pieces.setdefault(entry.partial_groups, []).append(reduced[start - lo : end - lo])
    for groups, views in pieces.items():
        flat = views[0] if len(views) == 1 else torch.cat(views)
        for group in groups:
            dist.all_reduce(flat, group=group)
        if len(views) > 1:
            offset = 0
            for view in views:
                view.copy_(flat[offset : offset + view.numel()])
                offset += view.numel()


@dataclass
class _OptimizerState:
    """An optimizer's state by parameter name: gathered into whole tensors and sliced back
    (single-file checkpoints), or as this rank's flat ranges (sharded DCP checkpoints)."""

    buckets: list[_Bucket]
    scheme: _AllReduce
    entries: dict[Tensor, _BucketEntry]
    by_shard: dict[Tensor, _BucketEntry]
    process_group: dist.ProcessGroup | None
    group_names: dict[Optimizer, list[list[str]]] = field(default_factory=dict)
    """Each attached optimizer's parameter names, group by group."""

    def attach(self, optimizer: Optimizer) -> None:
        """Re-point ``optimizer``'s groups at the shard parameters (see
        :meth:`GradientEngine.attach`), resharding any state it already has."""
        check_shardable(optimizer)
        names = [
            [_entry_of(self.entries, param).name for param in group["params"]]
            for group in optimizer.param_groups
        ]
        existing = {
            "state": {
                _entry_of(self.entries, param).name: state
                for param, state in optimizer.state.items()
            },
            "param_groups": [
                {**group, "params": group_names}
                for group, group_names in zip(optimizer.param_groups, names, strict=True)
            ],
        }
        self.group_names[optimizer] = names
        for group in optimizer.param_groups:
            shards = (_entry_of(self.entries, param).shard for param in group["params"])
            group["params"] = [shard for shard in shards if shard is not None]
        optimizer.state.clear()
        if existing["state"]:
            self.load(optimizer, existing)

    def gather(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name, on group rank 0 (``{}`` elsewhere).

        The layout is torch's ``Optimizer.state_dict()`` with names for ids: ``state`` maps
        each name to full, parameter-shaped tensors; ``param_groups[i]["params"]`` lists the
        names in the original order, so a plain unsharded optimizer over the same groups can
        ``load_state_dict`` it directly. Every rank of the group must call this.

        Raises:
            ValueError: If some buckets reduce over groups of their own (expert
                parallelism); save those shard by shard (DCP checkpoints) instead.
        """
        if any(bucket.scheme is not self.scheme for bucket in self.buckets):
            raise ValueError(
                "The whole optimizer state cannot be gathered onto one rank when some"
                " parameters are reduced over groups of their own (expert parallelism);"
                " save a sharded checkpoint (a DCP directory) instead."
            )
        meta = self._state_meta(optimizer)
        state = {name: dict(m.scalars) for name, m in meta.items()}
        no_state = _StateMeta()
        for bucket in self.buckets:
            keys = {kd for entry in bucket.entries for kd in meta.get(entry.name, no_state).sharded}
            for key, dtype in sorted(keys, key=str):
                full = self.scheme.gather_to_root(self._owned_state(optimizer, bucket, key, dtype))
                for entry in bucket.entries if full is not None else ():
                    if (key, dtype) in meta.get(entry.name, no_state).sharded:
                        piece = full[entry.offset : entry.offset + entry.numel]
                        # On the host: the whole state would not fit beside rank 0's own
                        # on its device; one bucket's worth at a time does.
                        whole = piece.view_as(_local(entry.param))
                        state[entry.name][key] = whole.to("cpu", copy=True)
        if self.scheme.rank != 0:
            return {}
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(
                optimizer.param_groups, self.group_names[optimizer], strict=True
            )
        ]
        return {"state": state, "param_groups": groups}

    def _state_meta(self, optimizer: Optimizer) -> dict[str, _StateMeta]:
        """Per parameter name: its scalar state and the keys of its elementwise state.

        Exchanged between ranks so all of them join the same collectives, even for buckets
        whose owned slice holds no state.
        """
        local = {}
        for shard, values in optimizer.state.items():
            entry = self.by_shard[shard]
            local[entry.name] = _StateMeta.of(values, shard.numel())
        everyone: list[dict[str, _StateMeta]] = [{} for _ in range(self.scheme.world_size)]
        dist.all_gather_object(everyone, local, group=self.process_group)
        merged: dict[str, _StateMeta] = {}
        for rank_meta in everyone:
            for name, meta in rank_meta.items():
                merged.setdefault(name, _StateMeta(meta.scalars)).sharded.update(meta.sharded)
        return merged

    def _owned_state(
        self, optimizer: Optimizer, bucket: _Bucket, key: str, dtype: torch.dtype
    ) -> Tensor:
        """This rank's owned range of a bucket, filled with state ``key`` where it exists."""
        lo, hi = bucket.owned
        owned = torch.zeros(hi - lo, dtype=dtype, device=bucket.params.device)
        for entry in bucket.entries:
            value = (
                optimizer.state.get(entry.shard, {}).get(key) if entry.shard is not None else None
            )
            if value is not None:
                start = entry.shard_offset - lo
                owned[start : start + value.numel()] = value
        return owned

    def load(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`gather` or a plain torch optimizer over the same
        groups), keeping only this rank's slices: any rank count can resume it.
        """
        _check_groups(state_dict["param_groups"], optimizer)
        full_state = _state_by_name(state_dict, self.group_names[optimizer])
        shard_states = {}
        for group in optimizer.param_groups:
            for shard in group["params"]:
                entry = self.by_shard[shard]
                shard_states[shard] = {
                    key: entry.shard_of(v) if is_elementwise(v, entry.numel) else v
                    for key, v in full_state.get(entry.name, {}).items()
                }
        self.load_shards(optimizer, shard_states, state_dict["param_groups"])

    def owned(self, optimizer: Optimizer) -> list[OwnedSlice]:
        """The flat ranges of parameters that ``optimizer`` steps on this rank, in order."""
        slices = []
        for group in optimizer.param_groups:
            for shard in group["params"]:
                entry = self.by_shard[shard]
                start = entry.shard_offset - entry.offset
                slices.append(OwnedSlice(entry.name, entry.param, start, shard))
        return slices

    def load_shards(
        self,
        optimizer: Optimizer,
        shard_states: dict[Tensor, dict[str, Any]],
        saved_groups: list[dict[str, Any]],
    ) -> None:
        """Give ``optimizer`` the state of each of its shard parameters (elementwise values
        already shard-sized) and the saved groups' hyperparameters."""
        _check_groups(saved_groups, optimizer)
        shards = [shard for group in optimizer.param_groups for shard in group["params"]]
        state = {i: shard_states[shard] for i, shard in enumerate(shards) if shard_states[shard]}
        groups, start = [], 0
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer.load_state_dict({"state": state, "param_groups": groups})


@dataclass(frozen=True)
class OwnedSlice:
    """A flat range of one parameter's local tensor that this rank's optimizer steps."""

    name: str
    """The parameter's name (the checkpoint key)."""
    param: Tensor
    """The model parameter (a DTensor under tensor parallelism)."""
    start: int
    """Where the range starts in the parameter's local tensor, flattened."""
    shard: Tensor
    """The 1-D parameter the optimizer steps: the range itself."""


class GradientEngine:
    """Bucketed, overlapped data-parallel gradient reduction with optional ZeRO sharding.

    Building the engine moves every trainable parameter into a flat bucket buffer (the
    ``Parameter`` objects stay, their ``.data`` becomes a view), broadcasts group rank 0's
    values, and hooks each parameter: when its gradient is accumulated, the hook adds it
    to the bucket's flat gradient buffer and frees ``param.grad`` (one copy, as Megatron's
    ``main_grad``); when a bucket's last gradient arrives, the bucket's collective is
    launched asynchronously, overlapping the rest of backward (in bucket order: a bucket
    waits for the earlier ones, see the module documentation). At the end of backward the
    engine waits for all collectives, averages, and points the shard parameters' ``.grad``
    at the reduced gradients (model parameters' ``.grad`` stay ``None``). :meth:`attach`
    hands an optimizer the shard parameters; after its ``step()`` the updated shards are
    all-gathered (or broadcast) into the model.

    Args:
        named_params: ``(name, parameter)`` pairs, e.g. ``module.named_parameters()``; those
            not requiring grad are left alone. Names key the full optimizer state.
        process_group: The data-parallel group; ``None`` for the default (world) group.
        stage: 0 (all-reduce), 1 (shard optimizer state), 2 (also shard gradients) or
            ``"parameter_server"`` (reduce to rank 0, which steps, then broadcast).
        bucket_size_mb: Target bucket size in MiB; larger buckets mean fewer, longer
            collectives, smaller ones start communicating earlier in backward.
        overlap_comm: Launch each bucket's collective from the gradient hooks as soon as
            the bucket is complete; if ``False``, all are launched after backward.
        compiled: The blocks are ``torch.compile``d: DTensor local shards get storages of
            their own over their bucket memory (no copy; see :func:`_rebind`).
        reduce_groups: Parameter name -> the group its gradient is summed over instead of
            ``process_group`` (a subgroup of it), still averaged by ``process_group``'s
            size: expert weights under expert parallelism (see :meth:`_Reductions.publish`).
        partition: Parameter name -> a key; a bucket holds parameters of one key only (a
            pipeline rank's model chunks, so that :meth:`launch` can start one chunk's
            buckets while another's backward still runs). Unnamed parameters share a key.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        stage: Stage = 2,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        compiled: bool = False,
        reduce_groups: Mapping[str, dist.ProcessGroup] | None = None,
        partition: Mapping[str, Hashable] | None = None,
    ) -> None:
        validate_engine_args(stage, bucket_size_mb)
        named_params = list(named_params)
        _check_named(reduce_groups or {}, {name for name, _ in named_params})
        named = [(name, param) for name, param in named_params if param.requires_grad]
        if not named:
            raise ValueError("The gradient engine got no parameters that require grad.")
        self.stage = stage
        self.process_group = process_group
        self.overlap_comm = overlap_comm
        self._scheme = _SCHEMES[stage](process_group)
        self._buckets = _build_buckets(
            named, self._scheme, reduce_groups or {}, partition or {}, bucket_size_mb, compiled
        )
        self._entries = {entry.param: entry for bucket in self._buckets for entry in bucket.entries}
        self._by_shard = {
            entry.shard: entry for entry in self._entries.values() if entry.shard is not None
        }
        self._hooks: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._on_grad_ready) for _, param in named
        ]
        self._state = _OptimizerState(
            self._buckets, self._scheme, self._entries, self._by_shard, process_group
        )
        self._sync_grads = True
        self._deferred = False
        self._finish_queued = False
        self._reductions = _Reductions(self._buckets, self._scheme.world_size)
        _broadcast_params(self._buckets)

    @property
    def world_size(self) -> int:
        """Size of the data-parallel group."""
        return self._scheme.world_size

    @property
    def num_buckets(self) -> int:
        """How many flat buckets the parameters were packed into."""
        return len(self._buckets)

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the largest bucket's parameters."""
        return max(b.params.numel() * b.params.element_size() for b in self._buckets)

    @property
    def bucket_numels(self) -> list[int]:
        """Padded element count of each bucket, in reduction order."""
        return [bucket.params.numel() for bucket in self._buckets]

    # ---- backward: accumulate, launch, finish ---------------------------------------------

    def _on_grad_ready(self, param: Tensor) -> None:
        entry = self._entries[param]
        bucket = entry.bucket
        assert param.grad is not None
        grad, entry.partial_groups = _local_grad(param)
        bucket.grad_buffer()[entry.offset : entry.offset + entry.numel].add_(grad.reshape(-1))
        param.grad = None
        if self._deferred or not (self._sync_grads or bucket.scheme.reduces_each_pass):
            return
        self._queue_end_of_backward()
        bucket.grads_arrived += 1
        if self.overlap_comm and bucket.complete:
            self._reductions.launch_ready()

    def _queue_end_of_backward(self) -> None:
        # Autograd runs queued callbacks once the whole backward pass is done (torch DDP
        # and FSDP finalize their reductions the same way).
        if not self._finish_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._finish_queued = True

    def _end_of_backward(self) -> None:
        self._finish_queued = False
        if self._sync_grads:
            self.finish_grad_sync()
        else:
            self._reductions.drain()  # ZeRO-2 accumulating: the rest into the shards

    def finish_grad_sync(self) -> None:
        """Reduce what is still pending, wait, average and expose the owned gradients.

        Runs automatically at the end of a synchronizing backward pass. Buckets not launched
        yet (one with a parameter that got no gradient, whose gradient counts as zero, and
        every bucket after it) are launched here, in bucket order.
        """
        self._finish_queued = False
        self._reductions.drain()
        for bucket in self._buckets:
            self._reductions.publish(bucket)

    def accumulated_grad(self, param: Tensor) -> Tensor:
        """The local, not yet reduced gradient of ``param`` (a view into its bucket), valid
        between backward passes run under :meth:`defer_reduction` and
        :meth:`finish_grad_sync`; a collective on it (e.g. summing a tied weight's gradient
        across pipeline stages) is folded into the coming reduction."""
        entry = _entry_of(self._entries, param)
        flat = entry.bucket.grad_buffer()[entry.offset : entry.offset + entry.numel]
        return flat.view_as(_local(param))

    def launch(self, params: Iterable[Tensor]) -> None:
        """Start reducing the buckets that hold ``params`` now, in bucket order, instead of
        at :meth:`finish_grad_sync` (which still waits for them). A no-op under
        :meth:`no_sync` and without ``overlap_comm``.

        For callers that accumulate under :meth:`defer_reduction` and know when some
        gradients are final before the others (a pipeline chunk whose last backward of
        the step has run). Every rank of the group must launch the same buckets in the
        same order, as for any collective.

        Raises:
            ValueError: If a bucket of ``params`` also holds other parameters (build the
                engine with a ``partition`` that separates them).
        """
        if self._sync_grads and self.overlap_comm:
            self._reductions.launch_holding({id(param) for param in params})

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes here do not finish the reduction (stages
        0, 1, parameter server: local sums, no communication; stage 2 reduce-scatters each
        pass into the 1/N shard and frees the buckets, DeepSpeed's way)."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    @contextmanager
    def defer_reduction(self) -> Iterator[None]:
        """Accumulate whole gradients locally, at every stage, until :meth:`finish_grad_sync`.

        For callers that run several backward passes and then act on the whole local
        gradient before reducing it (a pipeline's micro-batches, then summing a tied
        weight's two copies with :meth:`accumulated_grad`).
        """
        previous, self._deferred = self._deferred, True
        try:
            yield
        finally:
            self._deferred = previous

    # ---- optimizer ------------------------------------------------------------------------

    def attach(self, optimizer: Optimizer) -> None:
        """Make ``optimizer`` step this rank's shard parameters, then re-sync the model.

        The optimizer object is kept (LR schedulers hold it); each group's ``params`` is
        re-pointed at the shard parameters of its original parameters. State the optimizer
        already has (Adagrad creates it eagerly; a restored optimizer) is resharded.

        Raises:
            TypeError: If the optimizer is not elementwise (see :func:`check_shardable`).
            ValueError: If it steps a parameter the engine does not manage.
        """
        self._state.attach(optimizer)
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.sync_params()))

    def parameter_of(self, shard: Tensor) -> Tensor:
        """The model parameter that ``shard`` (a parameter the optimizer steps) is a slice of."""
        return self._by_shard[shard].param

    def sync_params(self) -> None:
        """Bring every rank's model up to date after the owners stepped their shards."""
        works = [bucket.scheme.sync_params(bucket) for bucket in self._buckets]
        for work in filter(None, works):  # stage 0 has nothing to sync
            with profiling.record(self._scheme.sync_phase):
                work.wait()

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """How the gradients of ``parameters`` (the optimizer's shards) lie across the group:
        replicated on every rank of their bucket's group at stage 0, disjoint shards
        otherwise."""
        pieces = [
            GradientPiece(p.grad, _replicas(self._by_shard[p].bucket.scheme))
            for p in parameters
            if p.grad is not None
        ]
        group = self.process_group or dist.group.WORLD
        return GradientLayout(group=group, pieces=pieces, device=self._buckets[0].params.device)

    # ---- full (unsharded) optimizer state, keyed by parameter name -------------------------

    def optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state by parameter name on group rank 0 (``{}`` elsewhere),
        loadable by a plain torch optimizer (see :meth:`_OptimizerState.gather`)."""
        return self._state.gather(optimizer)

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a whole state from any rank count, or a plain optimizer, keeping this rank's
        slices."""
        self._state.load(optimizer, state_dict)

    def owned_slices(self, optimizer: Optimizer) -> list[OwnedSlice]:
        """What ``optimizer`` steps on this rank, parameter by parameter (sharded saves)."""
        return self._state.owned(optimizer)

    def load_shard_states(
        self, optimizer: Optimizer, states: dict[Tensor, dict[str, Any]], groups: list[dict]
    ) -> None:
        """Load per-shard state (keyed by the shard parameters) and the groups' settings."""
        self._state.load_shards(optimizer, states, groups)

    def parameter_names(self, optimizer: Optimizer) -> list[str]:
        """Names of the parameters ``optimizer`` steps, group by group (after :meth:`attach`)."""
        return [name for group in self._state.group_names[optimizer] for name in group]

    # ---- accounting and teardown ---------------------------------------------------------

    def grad_bytes(self) -> int:
        """Bytes of gradient storage the engine holds on this rank right now."""
        return sum(t.numel() * t.element_size() for t in self.gradient_buffers())

    def gradient_buffers(self) -> list[Tensor]:
        """This rank's gradient storage now: full buckets (stages 0-1) or shards (stage 2)."""
        held = (t for b in self._buckets for t in (b.grads, b.shard_grads, b.shard_pending))
        return [t for t in held if t is not None]

    def remove(self) -> None:
        """Remove the gradient and optimizer hooks (parameters stay views of the buffers)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _check_named(reduce_groups: Mapping[str, dist.ProcessGroup], names: set[str]) -> None:
    """Raise unless every name given a group of its own is one of the parameters: a name
    spelled otherwise (another prefix) would silently reduce over the whole dp group."""
    unknown = sorted(set(reduce_groups) - names)
    if unknown:
        raise ValueError(
            f"reduce_groups names {len(unknown)} tensors that are not among the engine's"
            f" parameters ({', '.join(unknown[:3])}); name them as the module's"
            " named_parameters() does."
        )


def _build_buckets(
    named: list[tuple[str, Tensor]],
    scheme: _AllReduce,
    reduce_groups: Mapping[str, dist.ProcessGroup],
    partition: Mapping[str, Hashable],
    bucket_size_mb: float,
    compiled: bool,
) -> list[_Bucket]:
    """Pack the parameters into buckets of one reduction group and one ``partition`` key
    each: ``reduce_groups[name]`` where given (one scheme of ``scheme``'s stage per group),
    else ``scheme``'s group."""
    schemes = {group: type(scheme)(group) for group in set(reduce_groups.values())}
    of = [schemes[reduce_groups[name]] if name in reduce_groups else scheme for name, _ in named]
    params = [param for _, param in named]
    kinds = [(id(s), partition.get(name)) for s, (name, _) in zip(of, named, strict=True)]
    return [
        _pack_bucket([named[i] for i in indices], of[indices[0]], compiled)
        for indices in assign_buckets(params, bucket_size_mb, kinds)
    ]


def _entry_of(entries: dict[Tensor, _BucketEntry], param: Tensor) -> _BucketEntry:
    """``param``'s bucket entry; a parameter the engine does not manage is an error."""
    entry = entries.get(param)
    if entry is None:
        raise ValueError(
            f"The optimizer steps a parameter of shape {tuple(param.shape)} that the gradient"
            " engine does not manage; build the optimizer from the module's trainable"
            " parameters."
        )
    return entry


def _replicas(scheme: _AllReduce) -> int:
    """Ranks holding the same reduced gradient slice: the group at stage 0, else one."""
    return scheme.world_size if scheme.replicated else 1


def _rebind(param: Tensor, view: Tensor, own_storage: bool) -> None:
    """Make ``param``'s data (a DTensor's local shard) the bucket ``view``, through
    ``.data``. With ``own_storage``, a DTensor's local shard instead gets a storage object
    of its own over the view's memory (DLPack's, which keeps the bucket alive): torch
    2.13's compiler fails on DTensor parameters whose local shards share one storage
    ("Attempted to set the storage of a tensor on device cpu to a storage on different
    device meta")."""
    local = _local(param)
    if not (own_storage and isinstance(param, DTensor)):
        local.data = view
        return
    storage = torch.from_dlpack(view.detach()).untyped_storage()
    with torch.no_grad():
        local.set_(storage, 0, view.shape, view.stride())


def _local(param: Tensor) -> Tensor:
    """The tensor holding ``param``'s data on this rank: a DTensor's local shard, else itself.

    The engine buckets and reduces local shards, so it runs on a tensor-parallel model's
    ``dp`` group: each data-parallel group holds the same shard of every parameter.
    """
    return param._local_tensor if isinstance(param, DTensor) else param


def _local_grad(param: Tensor) -> tuple[Tensor, tuple[dist.ProcessGroup, ...]]:
    """``param.grad`` as a local tensor laid out like the parameter's local shard, and the
    groups it is still to be summed over.

    A replicated DTensor parameter used on sequence shards (sequence-parallel norm weights,
    a mixture of experts on local tokens) gets a gradient ``Partial`` over tp: its local
    part is returned with the tp groups, and summed over them once per step when the
    bucket is published (Megatron-LM's all-reduce of sequence-parallel layernorm
    gradients, done once rather than per micro-batch). Any other layout mismatch is
    redistributed here.
    """
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad, ()
    assert isinstance(param, DTensor)
    partial = [i for i, p in enumerate(grad.placements) if p.is_partial()]
    summed_later = all(
        (g.is_partial("sum") and p.is_replicate()) or g == p
        for g, p in zip(grad.placements, param.placements, strict=True)
    )
    if partial and summed_later:
        mesh = grad.device_mesh
        return grad.to_local(), tuple(mesh.get_group(i) for i in partial)
    return grad.redistribute(param.device_mesh, param.placements).to_local(), ()


def _check_groups(saved_groups: list[dict[str, Any]], optimizer: Optimizer) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint has {len(saved_groups)} optimizer param groups, the optimizer"
            f" has {len(optimizer.param_groups)}; build the optimizer with the same groups"
            " to resume."
        )


def _state_by_name(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``state_dict["state"]`` keyed by parameter name.

    Checkpoints written by the engine are already keyed by name; a plain torch optimizer's
    are keyed by position in its groups, which the original group order maps to names.
    """
    keys = [key for group in state_dict["param_groups"] for key in group["params"]]
    flat_names = [name for group in names for name in group]
    if all(isinstance(key, str) for key in keys):
        return dict(state_dict["state"])
    if len(keys) != len(flat_names):
        raise ValueError(
            f"The checkpoint's optimizer steps {len(keys)} parameters, this one"
            f" {len(flat_names)}; they must match to resume."
        )
    rename = dict(zip(keys, flat_names, strict=True))
    return {rename[key]: value for key, value in state_dict["state"].items()}
