"""The data-parallel gradient engine: bucketed, overlapped reduction with ZeRO-1/2 sharding.

:class:`GradientEngine` hooks every trainable parameter: a gradient goes into its flat
bucket (:mod:`~plugintrain.strategies.buckets`), and a complete bucket's collective starts
during backward. :class:`_Reductions` launches them in one fixed order, the same on every
rank, as NCCL needs; the shard parameters then carry the reduced gradients to the
optimizer (:mod:`~plugintrain.strategies.optimizer_shards`), whose updated shards are
synced back into the model after each step. The engine knows nothing about Lightning and
runs on any process group (a hybrid strategy's ``dp`` group); docs/architecture.md tells
the whole story (launch order, unused parameters, ``Partial`` gradients under tp).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from plugintrain.core import profiling
from plugintrain.core.contracts import GradientLayout
from plugintrain.strategies.buckets import (
    Bucket,
    BucketLayout,
    Stage,
    broadcast_params,
    local_tensor,
)
from plugintrain.strategies.optimizer_shards import OptimizerShards

# ZeRO-2 completes a bucket's reduce-scatter (and frees its full gradients) before it
# starts the next one's, so during backward a rank holds its 1/N shard plus two full
# buckets: the one on the network and the one filling. The earlier reduce-scatter had the
# whole time of filling the next bucket to finish, so backward rarely waits.
MAX_FULL_BUCKETS_IN_FLIGHT: Final = 1


class _Reductions:
    """The collectives of a backward pass, bucket by bucket, launched in bucket order.

    Every rank of a group must start the same collectives in the same order, so buckets
    that become complete launch only once every earlier bucket has launched
    (:meth:`launch_ready`); :meth:`drain` launches the rest in order. ZeRO-2 frees each
    bucket's full gradients once reduced; completing the previous bucket's collective
    before starting the next bounds how many exist at once (the backpressure DeepSpeed's
    buckets apply).
    """

    def __init__(self, buckets: list[Bucket], divisor: int) -> None:
        self.buckets = buckets
        self.divisor = divisor
        """What every summed gradient is divided by: the data-parallel degree."""
        self.in_flight: deque[Bucket] = deque()
        self.next = 0
        """Index of the first bucket not launched in this pass (all before it are)."""

    def launch(self, bucket: Bucket) -> None:
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

    def _complete(self, bucket: Bucket) -> None:
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

    def publish(self, bucket: Bucket) -> None:
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


def _sum_partial_grads(bucket: Bucket, reduced: Tensor) -> None:
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


class GradientEngine:
    """Bucketed, overlapped data-parallel gradient reduction with optional ZeRO sharding.

    Building the engine packs the trainable parameters into flat buckets
    (:class:`~plugintrain.strategies.buckets.BucketLayout`), broadcasts group rank 0's values
    and hooks each parameter: its gradient joins its bucket's flat buffer (one copy, as
    Megatron's ``main_grad``), and a complete bucket's collective starts at once, in bucket
    order. At the end of backward the shard parameters' ``.grad`` hold the averaged,
    reduced gradients. :meth:`attach` hands an optimizer the shard parameters
    (:attr:`shards`); after its ``step()`` the updated shards are synced into the model.

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
            their own over their bucket memory (no copy).
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
        self._layout = BucketLayout.pack(
            named_params, process_group, stage, bucket_size_mb, compiled, reduce_groups, partition
        )
        self.stage = stage
        self.process_group = process_group
        self.overlap_comm = overlap_comm
        self._hooks: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for param in self._layout.params
        ]
        self.shards = OptimizerShards(self._layout, process_group)
        """What attached optimizers step on this rank, and their state by parameter name."""
        self._sync_grads = True
        self._deferred = False
        self._finish_queued = False
        self._reductions = _Reductions(self._layout.buckets, self.world_size)
        broadcast_params(self._layout.buckets)

    @property
    def world_size(self) -> int:
        """Size of the data-parallel group."""
        return self._layout.scheme.world_size

    @property
    def num_buckets(self) -> int:
        """How many flat buckets the parameters were packed into."""
        return len(self._layout.buckets)

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the largest bucket's parameters."""
        return max(b.params.numel() * b.params.element_size() for b in self._layout.buckets)

    @property
    def bucket_numels(self) -> list[int]:
        """Padded element count of each bucket, in reduction order."""
        return [bucket.params.numel() for bucket in self._layout.buckets]

    # ---- backward: accumulate, launch, finish ---------------------------------------------

    def _on_grad_ready(self, param: Tensor) -> None:
        entry = self._layout.entries[param]
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
        for bucket in self._layout.buckets:
            self._reductions.publish(bucket)

    def accumulated_grad(self, param: Tensor) -> Tensor:
        """The local, not yet reduced gradient of ``param`` (a view into its bucket), valid
        between backward passes run under :meth:`defer_reduction` and
        :meth:`finish_grad_sync`; a collective on it (e.g. summing a tied weight's gradient
        across pipeline stages) is folded into the coming reduction."""
        entry = self._layout.entry_of(param)
        flat = entry.bucket.grad_buffer()[entry.offset : entry.offset + entry.numel]
        return flat.view_as(local_tensor(param))

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
            TypeError: If the optimizer is not elementwise (see
                :func:`~plugintrain.strategies.optimizer_shards.check_shardable`).
            ValueError: If it steps a parameter the engine does not manage.
        """
        self.shards.attach(optimizer)
        sync = self._layout.sync_params
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: sync()))

    def parameter_of(self, shard: Tensor) -> Tensor:
        """The model parameter that ``shard`` (a parameter the optimizer steps) is a slice of."""
        return self.shards.parameter_of(shard)

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """How the gradients of ``parameters`` (the optimizer's shards) lie across the group
        (see :meth:`OptimizerShards.gradient_layout`)."""
        return self.shards.gradient_layout(parameters)

    # ---- full (unsharded) optimizer state, keyed by parameter name -------------------------

    def optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state by parameter name on group rank 0 (``{}`` elsewhere),
        loadable by a plain torch optimizer (see :meth:`OptimizerShards.gather`)."""
        return self.shards.gather(optimizer)

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a whole state from any rank count, or a plain optimizer, keeping this rank's
        slices."""
        self.shards.load(optimizer, state_dict)

    # ---- accounting and teardown ---------------------------------------------------------

    def grad_bytes(self) -> int:
        """Bytes of gradient storage the engine holds on this rank right now."""
        return sum(t.numel() * t.element_size() for t in self.gradient_buffers())

    def gradient_buffers(self) -> list[Tensor]:
        """This rank's gradient storage now: full buckets (stages 0-1) or shards (stage 2)."""
        buckets = self._layout.buckets
        held = (t for b in buckets for t in (b.grads, b.shard_grads, b.shard_pending))
        return [t for t in held if t is not None]

    def remove(self) -> None:
        """Remove the gradient and optimizer hooks (parameters stay views of the buffers)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


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
