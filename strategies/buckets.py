"""Flat gradient buckets, and the data-parallel schemes that reduce and sync them.

Parameters become views into flat per-bucket buffers padded to a multiple of the group
size (Megatron-LM's ``param_and_grad_buffer.py``), so rank ``r`` owns the contiguous range
``[r * S, (r + 1) * S)`` of each bucket. One scheme per stage (Rajbhandari et al., "ZeRO",
SC'20, section 5) says how a bucket is reduced, which range a rank owns and how updated
parameters reach every rank: ``0`` all-reduce, ``1`` all-reduce and shard the optimizer,
``2`` reduce-scatter, ``"parameter_server"`` reduce to rank 0 and broadcast back.
:class:`BucketLayout` packs an engine's parameters; docs/architecture.md tells the story.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from plugintrain.core import profiling

PARAMETER_SERVER: Final = "parameter_server"
Stage: TypeAlias = Literal[0, 1, 2, "parameter_server"]
STAGES: Final[tuple[Stage, ...]] = (0, 1, 2, PARAMETER_SERVER)


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
        nbytes = local_tensor(param).numel() * param.element_size()
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


@dataclass(eq=False)
class BucketEntry:
    """One parameter's place in its bucket (and the optimizer's shard of it, if owned)."""

    name: str
    param: Tensor
    bucket: Bucket
    offset: int
    numel: int
    shard: nn.Parameter | None = None
    shard_offset: int = 0
    partial_groups: tuple[dist.ProcessGroup, ...] = ()
    """The groups the accumulated gradient is still to be summed over (its ``Partial`` tp
    dims, see the engine's gradient hook); empty for a gradient that arrives whole."""

    def shard_of(self, full: Tensor) -> Tensor:
        """The part of a full, parameter-shaped tensor that this rank's shard covers."""
        assert self.shard is not None
        start = self.shard_offset - self.offset
        return full.reshape(-1)[start : start + self.shard.numel()]


@dataclass(eq=False)
class Bucket:
    """A flat parameter buffer, its gradient buffer and the rank's owned range."""

    params: Tensor
    owned: tuple[int, int]
    scheme: AllReduce
    """How the bucket is reduced and synced, over which group."""
    entries: list[BucketEntry] = field(default_factory=list)
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


class AllReduce:
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

    def after_reduce(self, bucket: Bucket) -> None:
        """Runs once the bucket's collective has completed."""

    def owned(self, numel: int) -> tuple[int, int]:
        return 0, numel

    def reduce(self, bucket: Bucket) -> dist.Work:
        return dist.all_reduce(bucket.grad_buffer(), group=self.group, async_op=True)

    def reduced_grads(self, bucket: Bucket) -> Tensor:
        assert bucket.grads is not None
        lo, hi = bucket.owned
        return bucket.grads[lo:hi]

    def sync_params(self, bucket: Bucket) -> dist.Work | None:
        return None

    def gather_to_root(self, owned: Tensor) -> Tensor | None:
        """A full flat buffer from each rank's owned piece, on group rank 0 only."""
        return owned if self.rank == 0 else None


class ShardedOptimizer(AllReduce):
    """Stage 1: all-reduced gradients, optimizer state for the owned 1/N slice only."""

    replicated = False

    def owned(self, numel: int) -> tuple[int, int]:
        return shard_range(numel, self.rank, self.world_size)

    def sync_params(self, bucket: Bucket) -> dist.Work | None:
        lo, hi = bucket.owned
        # In-place all-gather: the owned slice is already at its place in the output.
        return dist.all_gather_single(bucket.params, bucket.params[lo:hi], self.group, True)

    def gather_to_root(self, owned: Tensor) -> Tensor | None:
        pieces = [torch.empty_like(owned) for _ in range(self.world_size)]
        dist.gather(owned, pieces if self.rank == 0 else None, dst=self.root, group=self.group)
        return torch.cat(pieces) if self.rank == 0 else None


class ShardedGradients(ShardedOptimizer):
    """Stage 2: reduce-scatter, so only the owned gradient slice outlives the reduction."""

    reduce_phase = profiling.GRAD_REDUCE_SCATTER

    @property
    def frees_grads(self) -> bool:
        return True

    @property
    def reduces_each_pass(self) -> bool:
        return True

    def reduce(self, bucket: Bucket) -> dist.Work:
        assert bucket.shard_grads is not None
        if bucket.shard_fresh:  # the step's first pass writes the shard directly
            out, bucket.shard_fresh = bucket.shard_grads, False
        else:
            out = bucket.shard_pending = torch.empty_like(bucket.shard_grads)
        return dist.reduce_scatter_single(
            out, bucket.grad_buffer(), group=self.group, async_op=True
        )

    def after_reduce(self, bucket: Bucket) -> None:
        assert bucket.shard_grads is not None
        if bucket.shard_pending is not None:
            bucket.shard_grads.add_(bucket.shard_pending)
            bucket.shard_pending = None
        bucket.grads = None  # the pass's full gradients now live in the shard

    def reduced_grads(self, bucket: Bucket) -> Tensor:
        assert bucket.shard_grads is not None
        return bucket.shard_grads


class ParameterServer(AllReduce):
    """Gradients reduced to rank 0, which alone steps; parameters broadcast back."""

    replicated = False
    reduce_phase = profiling.GRAD_REDUCE
    sync_phase = profiling.PARAM_BROADCAST

    @property
    def frees_grads(self) -> bool:
        return self.rank != 0

    def owned(self, numel: int) -> tuple[int, int]:
        return (0, numel) if self.rank == 0 else (0, 0)

    def reduce(self, bucket: Bucket) -> dist.Work:
        return dist.reduce(bucket.grad_buffer(), dst=self.root, group=self.group, async_op=True)

    def sync_params(self, bucket: Bucket) -> dist.Work | None:
        return dist.broadcast(bucket.params, src=self.root, group=self.group, async_op=True)


SCHEMES: dict[Stage, type[AllReduce]] = {
    0: AllReduce,
    1: ShardedOptimizer,
    2: ShardedGradients,
    PARAMETER_SERVER: ParameterServer,
}


@dataclass(eq=False)
class BucketLayout:
    """Where an engine's trainable parameters live: its buckets, and each parameter's (and
    each shard parameter's) entry in them. Build it with :meth:`pack`."""

    scheme: AllReduce
    """The scheme of the engine's own group (a bucket reduced over another group has a
    scheme of the same stage for that group)."""
    buckets: list[Bucket]
    params: list[Tensor]
    """The trainable parameters, in the order given."""
    entries: dict[Tensor, BucketEntry]
    """Model parameter -> its entry."""
    by_shard: dict[Tensor, BucketEntry]
    """Shard parameter (what the optimizer steps) -> its entry."""

    @classmethod
    def pack(
        cls,
        named_params: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None,
        stage: Stage,
        bucket_size_mb: float,
        compiled: bool = False,
        reduce_groups: Mapping[str, dist.ProcessGroup] | None = None,
        partition: Mapping[str, Hashable] | None = None,
    ) -> BucketLayout:
        """Move the parameters that require grad into buckets (the arguments are
        :class:`~plugintrain.strategies.GradientEngine`'s), after validating them."""
        validate_engine_args(stage, bucket_size_mb)
        named_params = list(named_params)
        _check_named(reduce_groups or {}, {name for name, _ in named_params})
        named = [(name, param) for name, param in named_params if param.requires_grad]
        if not named:
            raise ValueError("The gradient engine got no parameters that require grad.")
        scheme = SCHEMES[stage](process_group)
        buckets = _build_buckets(
            named, scheme, reduce_groups or {}, partition or {}, bucket_size_mb, compiled
        )
        entries = {entry.param: entry for bucket in buckets for entry in bucket.entries}
        by_shard = {entry.shard: entry for entry in entries.values() if entry.shard is not None}
        return cls(scheme, buckets, [param for _, param in named], entries, by_shard)

    def entry_of(self, param: Tensor) -> BucketEntry:
        """``param``'s bucket entry; a parameter the engine does not manage is an error."""
        entry = self.entries.get(param)
        if entry is None:
            raise ValueError(
                f"The optimizer steps a parameter of shape {tuple(param.shape)} that the gradient"
                " engine does not manage; build the optimizer from the module's trainable"
                " parameters."
            )
        return entry

    def sync_params(self) -> None:
        """Bring every rank's model up to date after the owners stepped their shards."""
        works = [bucket.scheme.sync_params(bucket) for bucket in self.buckets]
        for work in filter(None, works):  # stage 0 has nothing to sync
            with profiling.record(self.scheme.sync_phase):
                work.wait()


def broadcast_params(buckets: list[Bucket]) -> None:
    """Start every replica from its group's rank 0's weights, as torch DDP does."""
    works = [
        dist.broadcast(b.params, src=b.scheme.root, group=b.scheme.group, async_op=True)
        for b in buckets
    ]
    for work in works:
        work.wait()


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
    scheme: AllReduce,
    reduce_groups: Mapping[str, dist.ProcessGroup],
    partition: Mapping[str, Hashable],
    bucket_size_mb: float,
    compiled: bool,
) -> list[Bucket]:
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


def _pack_bucket(
    named: list[tuple[str, Tensor]], scheme: AllReduce, compiled: bool = False
) -> Bucket:
    """Move the parameters' data into one flat buffer (the ``Parameter`` objects stay, their
    ``.data`` becomes a view) and make this rank's shard parameters of the owned range.
    With ``compiled``, DTensor local shards get storages of their own (see
    :func:`_rebind`)."""
    numel = sum(local_tensor(param).numel() for _, param in named)
    first = local_tensor(named[0][1])
    padded = padded_numel(numel, scheme.world_size)
    if len(named) == 1 and padded == numel and first.is_contiguous():
        flat = first.detach().view(-1)  # adopt its storage: no second copy of a big tensor
    else:
        flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    bucket = Bucket(params=flat, owned=scheme.owned(flat.numel()), scheme=scheme)
    offset = 0
    for name, param in named:
        local = local_tensor(param)
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


def _make_entry(name: str, param: Tensor, bucket: Bucket, offset: int) -> BucketEntry:
    numel = local_tensor(param).numel()
    entry = BucketEntry(name, param, bucket, offset, numel)
    lo = max(offset, bucket.owned[0])
    hi = min(offset + numel, bucket.owned[1])
    if lo < hi:
        entry.shard = nn.Parameter(bucket.params[lo:hi])
        entry.shard_offset = lo
    return entry


def _rebind(param: Tensor, view: Tensor, own_storage: bool) -> None:
    """Make ``param``'s data (a DTensor's local shard) the bucket ``view``, through
    ``.data``. With ``own_storage``, a DTensor's local shard instead gets a storage object
    of its own over the view's memory (DLPack's, which keeps the bucket alive): torch
    2.13's compiler fails on DTensor parameters whose local shards share one storage
    ("Attempted to set the storage of a tensor on device cpu to a storage on different
    device meta")."""
    local = local_tensor(param)
    if not (own_storage and isinstance(param, DTensor)):
        local.data = view
        return
    storage = torch.from_dlpack(view.detach()).untyped_storage()
    with torch.no_grad():
        local.set_(storage, 0, view.shape, view.stride())


def local_tensor(param: Tensor) -> Tensor:
    """The tensor holding ``param``'s data on this rank: a DTensor's local shard, else itself.

    The engine buckets and reduces local shards, so it runs on a tensor-parallel model's
    ``dp`` group: each data-parallel group holds the same shard of every parameter.
    """
    return param._local_tensor if isinstance(param, DTensor) else param
