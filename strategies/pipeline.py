"""Pipeline parallelism: stage splitting and one executor for every schedule.

:func:`split_model` cuts any :class:`~plugintrain.core.contracts.StagedModel` (the zoo's
``Transformer``, or a new family that implements the protocol) into this rank's virtual
stages in place (torchtitan's layout: the ``layers`` ``ModuleDict`` keeps the full-model
keys of the layers it still holds, and the embedding and head are dropped on the ranks
that do not run the first or last stage), so parameter names, tensor-parallel plans and
checkpoints keep their full-model paths. :class:`PipelineOptions` groups how a pipeline
runs (schedule, micro-batches, uneven stages, wire dtype).

:class:`PipelineExecutor` runs any :class:`~plugintrain.strategies.pipeline_schedules.
Schedule`: each action is the forward or backward of one micro-batch through one chunk.
Activations and their gradients travel in the batches of
:func:`~plugintrain.strategies.pipeline_schedules.p2p_plan`, each posted with one
``batch_isend_irecv`` (a tag per message for gloo; NCCL matches each link in order):
before each action, the send of what the previous action produced together with the
receive this action needs (with vpp > 1 sometimes also a later action's), so two
neighbours that send to each other at once never wait on each other, as two lone sends
would on NCCL beyond its eager threshold (NVIDIA/nccl#479). The simulator proves these
batches complete where every send waits for its receive (``check_rendezvous``). Every
transfer, even a lone one, goes through ``batch_isend_irecv``, so NCCL carries them all
on the group's one communicator, in the order the simulator checks; each rank posts its
first batch before it waits for any other, so every rank of the group joins that
communicator's lazy creation, which the first ``batch_isend_irecv`` needs. A batch's
receives are waited for at once. Every message has a fixed shape, ``(micro-batch,
sequence (/ tp with SP), hidden)``, and a fixed wire dtype (by default the training
compute dtype: bf16 under bf16 training halves the bytes of fp32), so bf16 autocast
outputs never meet a receive buffer of another dtype; a received activation is cast to
the dtype the stage's activations have in one process (``activation_dtype``: bf16
weights under ``bf16-true`` take bf16 inputs). Activations are freed as soon as
their backward has run, a sent tensor as soon as the schedule proves it delivered (an
answer from its receiver has arrived: ``release_points``), and gradients are received
into reused buffers (one; two where a receive comes an action early). A model with an
auxiliary loss (:class:`~plugintrain.core.contracts.HasAuxiliaryLoss`: mixture-of-experts
balance losses) has it taken after each training forward of a chunk and stashed with the
output; its backward includes it, scaled as the loss is.

As soon as the last backward of a chunk in a training step has run, the executor hands
the chunk over (``chunk_done``), so the strategy starts reducing its gradients over dp
while the cool-down runs the other chunks' backward (Megatron-LM's per-chunk overlap).
Each step leaves an ordered log of what it did (:class:`StepEvent`), and the time it
spent waiting on transfers: host time on the CPU, CUDA events on the current stream on
GPUs, where ``wait()`` does not block the host (:class:`StepClock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from plugintrain.core.contracts import HasAuxiliaryLoss, StagedModel
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_schedules import (
    Action,
    Batch,
    Message,
    Schedule,
    Transfer,
    build_schedule,
    forward_only,
    p2p_plan,
    release_points,
)
from plugintrain.strategies.pipeline_schedules import validate as validate_schedule

ContextFactory = Callable[[], AbstractContextManager]
AUTO = "auto"
"""``layers_per_stage: auto``: the split is measured and chosen at setup."""


def check_layers(
    n_layer: int, pp: int, vpp: int, layers_per_stage: Sequence[int] | str | None = None
) -> None:
    """Raise a ``ValueError`` naming the fix unless ``n_layer`` splits into ``pp * vpp`` chunks.

    Args:
        n_layer: Transformer blocks of the model.
        pp: Pipeline ranks.
        vpp: Chunks per rank.
        layers_per_stage: Blocks of each virtual stage, in stage order; None: equal;
            ``"auto"``: chosen from measured costs (at least one block per stage).
    """
    stages = pp * vpp
    if layers_per_stage == AUTO:
        if n_layer < stages:
            raise ValueError(
                f"layers_per_stage=auto needs a block per stage: n_layer={n_layer} <"
                f" pipeline_parallel={pp} x virtual_pipeline_parallel={vpp}; use fewer stages"
            )
        return
    if isinstance(layers_per_stage, str):
        raise ValueError(
            f"layers_per_stage={layers_per_stage!r} is neither 'auto' nor a list of block"
            " counts per stage (e.g. [5, 3])"
        )
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != stages or sum(counts) != n_layer or min(counts) < 0:
            raise ValueError(
                f"layers_per_stage={counts} must list {stages} (pipeline_parallel={pp} x"
                f" virtual_pipeline_parallel={vpp}) non-negative layer counts summing to"
                f" n_layer={n_layer}."
            )
        return
    if n_layer % stages:
        divisors = [d for d in range(1, n_layer + 1) if n_layer % d == 0]
        raise ValueError(
            f"n_layer={n_layer} is not divisible by pipeline_parallel={pp} x"
            f" virtual_pipeline_parallel={vpp} = {stages} stages; pick pp x vpp among"
            f" {divisors}, or give layers_per_stage (e.g. fewer layers on the last stage,"
            " which also runs the head and the loss)."
        )


def stage_layer_keys(
    n_layer: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[list[str]]:
    """The ``layers`` keys of each virtual stage: contiguous runs, equal unless given."""
    counts = list(layers_per_stage or [n_layer // num_stages] * num_stages)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [
        [str(i) for i in range(start, start + n)] for start, n in zip(starts, counts, strict=True)
    ]


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline runs, beside its degrees (``pipeline_parallel`` and
    ``virtual_pipeline_parallel`` are degrees of the mesh and live in ``ParallelDims``).

    Build it with :meth:`resolve`, which fills the defaults from the degrees and refuses
    a schedule that cannot run them.
    """

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved``."""
    microbatches: int = 1
    """Micro-batches each batch is cut into."""
    layers_per_stage: tuple[int, ...] | Literal["auto"] | None = None
    """Blocks of each virtual stage, in stage order; None: equal; ``"auto"``: measured
    and chosen when the strategy sets up (:mod:`~plugintrain.strategies.balance`)."""
    wire_dtype: torch.dtype | None = None
    """Dtype of the activations and gradients sent between stages; None: the training
    compute dtype (bf16 under ``bf16-mixed``/``bf16-true``, fp16 under ``16-mixed``,
    fp32 under ``32-true``), chosen by the runtime from the precision plugin."""

    @classmethod
    def resolve(
        cls,
        dims: ParallelDims,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: Sequence[int] | str | None = None,
        wire_dtype: torch.dtype | str | None = None,
    ) -> PipelineOptions:
        """Defaults from ``dims`` (``1f1b``, or ``interleaved`` with vpp > 1; ``microbatches =
        pipeline_parallel``), validated when ``dims`` has a pipeline.

        Raises:
            ValueError: On a schedule that cannot run the degrees, or an unknown dtype.
        """
        vpp = dims.virtual_pipeline_parallel
        options = cls(
            schedule=schedule or ("interleaved" if vpp > 1 else "1f1b"),
            microbatches=dims.pipeline_parallel if microbatches is None else microbatches,
            layers_per_stage=_layer_counts(layers_per_stage),
            wire_dtype=_dtype(wire_dtype),
        )
        if dims.pipeline_parallel > 1:
            validate_schedule(dims.pipeline_parallel, vpp, options.microbatches, options.schedule)
        return options


def _layer_counts(value: Sequence[int] | str | None) -> tuple[int, ...] | Literal["auto"] | None:
    if value is None or value == AUTO:
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        raise ValueError(
            f"layers_per_stage={value!r} is neither 'auto' nor a list of block counts per"
            " stage (e.g. [5, 3])"
        )
    return tuple(value)


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"wire_dtype={value!r} is not a torch dtype; use e.g. 'float32'.")
    return dtype


@dataclass
class VirtualStage:
    """One virtual stage of a split :class:`~plugintrain.core.contracts.StagedModel`: which of
    the model's blocks it runs, and whether it embeds (first) or runs the head (last).

    Not a module: the modules stay registered on the split model, under their full-model
    names, so plans and checkpoints keep their paths.
    """

    model: StagedModel
    index: int
    """The virtual stage's place in the whole pipeline (0 embeds, the last runs the head)."""
    layer_keys: list[str]
    is_first: bool
    is_last: bool

    def __call__(self, x: Tensor, seq_len: int) -> Tensor:
        """Token ids ``(B, T)`` (first stage) or hidden states in; hidden states or logits out.

        Args:
            x: The stage input.
            seq_len: The full sequence length ``T`` (hidden states may be sequence shards).
        """
        positions = torch.arange(seq_len, device=x.device)
        h = self.model.embed(x, positions) if self.is_first else x
        h = self.model.run_layers(h, self.layer_keys, positions)
        return self.model.head(h) if self.is_last else h


def split_model(
    model: StagedModel,
    rank: int,
    pp: int,
    vpp: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[VirtualStage]:
    """Keep only pipeline rank ``rank``'s ``vpp`` virtual stages of ``model`` (in place).

    Virtual stage ``c * pp + rank`` is the rank's chunk ``c``. The first stage keeps the
    embeddings, the last the final norm and the head (see ``StagedModel.keep_stage``). A
    head tied to the embedding stays the same ``Parameter`` on the last stage; the
    strategy keeps the two copies equal (:mod:`plugintrain.strategies.tied`).

    Args:
        model: The full model, the same (seeded) on every rank; its ``layers`` keys are
            ``"0"`` to ``str(n_layer - 1)``.
        rank: This pipeline rank.
        pp: Pipeline ranks.
        vpp: Virtual stages per rank.
        layers_per_stage: Blocks of each virtual stage (e.g. ``[5, 3]`` to give the
            last stage, which also runs the head, fewer); None: equal runs.

    Returns:
        The rank's virtual stages, in chunk order.
    """
    n_layer = len(model.layers)
    check_layers(n_layer, pp, vpp, layers_per_stage)
    num_stages = pp * vpp
    keys = stage_layer_keys(n_layer, num_stages, layers_per_stage)
    stages = [c * pp + rank for c in range(vpp)]
    owned = {key for s in stages for key in keys[s]}
    model.keep_stage(owned, first=0 in stages, last=num_stages - 1 in stages)
    return [
        VirtualStage(model, s, keys[s], is_first=s == 0, is_last=s == num_stages - 1)
        for s in stages
    ]


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _elapsed_seconds(begin: Any, end: Any) -> float:
    end.synchronize()  # the later event: once it has happened, so has ``begin``
    return begin.elapsed_time(end) / 1000.0  # CUDA events measure milliseconds


class StepClock:
    """The seconds of one pipeline step and of its waits on communication.

    On the CPU (gloo) a ``wait()`` blocks the host, so host time measures it. On CUDA
    (NCCL) ``wait()`` returns at once, having made the current stream wait for the
    transfer, and host time reads ~0: there the clock records events on the current
    stream before and after each wait and at the step's ends, and reads the time between
    them (how long the stream was held up) only when asked, so measuring adds no
    synchronization to the step.

    Args:
        event_factory: Makes a timing event (``torch.cuda.Event(enable_timing=True)``);
            injected by tests.
    """

    def __init__(self, event_factory: Callable[[], Any] = _timing_event) -> None:
        self._new_event = event_factory
        self._on_device = False
        self._host_wait = self._host_step = self._started = 0.0
        self._waits: list[tuple[Any, Any]] = []
        self._step: list[Any] = []

    def start(self, device: torch.device) -> None:
        """Begin a step on ``device`` (events on CUDA, host time elsewhere)."""
        self._on_device = device.type == "cuda"
        self._host_wait, self._waits, self._step = 0.0, [], []
        if self._on_device:
            self._step.append(self._recorded())
        self._started = time.perf_counter()

    def stop(self) -> None:
        """End the step."""
        self._host_step = time.perf_counter() - self._started
        if self._on_device:
            self._step.append(self._recorded())

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's time as waiting on communication."""
        if not self._on_device:
            started = time.perf_counter()
            try:
                yield
            finally:
                self._host_wait += time.perf_counter() - started
            return
        begin = self._recorded()
        yield
        self._waits.append((begin, self._recorded()))

    @property
    def wait_seconds(self) -> float:
        """Seconds the step spent waiting (see :meth:`waiting`)."""
        if not self._on_device:
            return self._host_wait
        return sum(_elapsed_seconds(begin, end) for begin, end in self._waits)

    @property
    def step_seconds(self) -> float:
        """Seconds from :meth:`start` to :meth:`stop` (on the device's timeline on CUDA)."""
        if len(self._step) < 2:
            return self._host_step
        return _elapsed_seconds(*self._step)

    def _recorded(self) -> Any:
        event = self._new_event()
        event.record()  # on the current stream, which ``wait()`` makes wait
        return event


class _Wire:
    """One rank's point-to-point traffic during a step: it posts the batches of
    :func:`~plugintrain.strategies.pipeline_schedules.p2p_plan` and holds what is in
    flight (tensors produced and not yet sent, received and not yet used, sends not yet
    known to be delivered). ``record_range`` opens the profiling range of a post or a wait
    (see :class:`PipelineExecutor`); ``clock`` times the waits."""

    def __init__(
        self,
        peers: list[int],
        group: dist.ProcessGroup | None,
        wire_dtype: torch.dtype,
        record_range: Callable[[str], AbstractContextManager] = nullcontext,
    ) -> None:
        self.peers, self.group, self.wire_dtype = peers, group, wire_dtype
        self.record_range = record_range
        self.outbox: dict[Message, Tensor] = {}  # produced by the last action, sent next
        self.inbox: dict[Message, Tensor] = {}  # received, until its action takes it
        self.sends: dict[Message, tuple[list[dist.Work], Tensor]] = {}
        self.spare_grads: list[Tensor] = []  # gradient buffers to receive into again
        self.clock = StepClock()
        self.microbatches = 1

    def start_step(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.outbox.clear()
        self.inbox.clear()

    def tag(self, message: Message) -> int:
        """A distinct tag per message of a step: the producing stage, micro-batch, direction
        (gloo matches by tag; NCCL ignores tags and matches each link in order)."""
        kind, stage, microbatch = message
        return (stage * self.microbatches + microbatch) * 2 + (kind == "B")

    def post(self, batch: Batch, shape: tuple[int, ...], device: torch.device) -> None:
        """Post one batch with ``batch_isend_irecv`` and wait for its receives.

        Gloo answers one work per transfer; NCCL coalesces the batch into one, which then
        stands for every transfer in it. A send is waited for later (:meth:`release`).
        """
        if not batch:
            return
        ops = [self._op(t, shape, device) for t in batch]
        with self.record_range("pipeline_post"):
            works = dist.batch_isend_irecv(ops)
        each = [[work] for work in works] if len(works) == len(ops) else [works] * len(ops)
        with self.clock.waiting():
            for t, op, work in zip(batch, ops, each, strict=True):
                if t.op == "send":
                    self.sends[t.message] = (work, op.tensor)
                    continue
                with self.record_range("pipeline_recv_wait"):
                    for w in work:
                        w.wait()
                self.inbox[t.message] = op.tensor

    def _op(self, t: Transfer, shape: tuple[int, ...], device: torch.device) -> dist.P2POp:
        peer, tag = self.peers[t.peer], self.tag(t.message)
        if t.op == "send":
            wire = self.outbox.pop(t.message).detach().to(self.wire_dtype).contiguous()
            return dist.P2POp(dist.isend, wire, peer, self.group, tag)
        spare = self.spare_grads.pop() if t.message[0] == "B" and self.spare_grads else None
        if spare is None or spare.shape != shape or spare.device != device:
            spare = torch.empty(shape, dtype=self.wire_dtype, device=device)
        return dist.P2POp(dist.irecv, spare, peer, self.group, tag)

    def reuse(self, grad: Tensor) -> None:
        """Receive a later gradient into ``grad``, which its backward has finished with."""
        self.spare_grads.append(grad)

    def release(self, messages: list[Message]) -> None:
        """Complete and drop sends that the schedule proves delivered
        (:func:`~plugintrain.strategies.pipeline_schedules.release_points`), so each sent
        tensor is freed as soon as nothing else (the stash) holds it."""
        if not messages:
            return
        with self.clock.waiting():
            for message in messages:
                works, _ = self.sends.pop(message)
                with self.record_range("pipeline_send_wait"):
                    for work in works:
                        work.wait()


class StepEvent(NamedTuple):
    """One thing a pipeline rank did in a step, in order (:attr:`PipelineExecutor.events`)."""

    kind: Literal["F", "B", "R"]
    """A forward, a backward, or the hand-over of a chunk's final gradients for reduction
    (``chunk_done``)."""
    chunk: int
    microbatch: int | None
    """None for ``"R"``."""
    seconds: float
    """When it began (``time.perf_counter()``: comparable across processes of one host)."""


Plan = tuple[list[Batch], dict[int, list[Message]], dict[int, int]]
"""A rank's transfer batches, release points, and the action indices after which each
chunk's gradients are final (index -> chunk)."""


class PipelineExecutor:
    """Runs a schedule's actions for one pipeline rank.

    Args:
        stages: This rank's virtual stages, in chunk order (from :func:`split_model`).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``.
        pp: Pipeline ranks.
        vpp: Chunks per rank.
        microbatches: Micro-batches per step.
        rank: This rank's pipeline rank.
        group: The pipeline process group (ranks in pipeline order); None: the world.
        loss_fn: ``loss_fn(logits, targets)`` -> mean loss, run on the last stage.
        hidden_size: Width of the activations between stages.
        seq_divisor: The activations hold ``seq_len / seq_divisor`` positions (tp with SP).
        wire_dtype: Dtype of every activation and gradient on the wire.
        forward_context: Entered around each forward (the precision plugin's autocast).
        backward_context: Entered around each backward (``loss_parallel`` with tp).
        record_range: Opens a named profiling range (:func:`plugintrain.core.profiling.record`)
            around each forward and backward and the wire's posts and waits; the default
            records nothing. Injected, so the executor runs without a profiler.
        activation_dtype: Received activations are cast to it before a stage runs on them:
            the dtype of a stage's activations in one process (bf16 weights under
            ``bf16-true``; fp32 under autocast, whose residual stream is fp32). None: as
            received.
        chunk_done: Called with a chunk's index as soon as the last backward of that chunk
            in a training step has run (its gradients are final), while the schedule goes
            on with the other chunks: the strategy starts their data-parallel reduction
            there, as Megatron-LM does per model chunk.

    Attributes:
        peak_stashed: Most micro-batch chunks held for backward during the last step.
        events: What the last step did, in order (:class:`StepEvent`).
    """

    def __init__(
        self,
        stages: list[VirtualStage],
        schedule: str,
        pp: int,
        vpp: int,
        microbatches: int,
        rank: int,
        group: dist.ProcessGroup | None,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        hidden_size: int,
        seq_divisor: int = 1,
        wire_dtype: torch.dtype = torch.float32,
        forward_context: ContextFactory = nullcontext,
        backward_context: ContextFactory = nullcontext,
        record_range: Callable[[str], AbstractContextManager] = nullcontext,
        activation_dtype: torch.dtype | None = None,
        chunk_done: Callable[[int], None] | None = None,
    ) -> None:
        if len(stages) != vpp:
            raise ValueError(f"Rank {rank} got {len(stages)} virtual stages for vpp={vpp}.")
        self.stages = stages
        self.pp, self.vpp, self.rank = pp, vpp, rank
        self.train_schedule = build_schedule(schedule, pp, vpp, microbatches)
        self._plans: dict[tuple, Plan] = {}
        self.group = group
        self.peers = dist.get_process_group_ranks(group) if group is not None else list(range(pp))
        self._wire = _Wire(self.peers, group, wire_dtype, record_range)
        self.record_range = record_range
        self.loss_fn = loss_fn
        self.hidden_size = hidden_size
        self.seq_divisor = seq_divisor
        self.forward_context = forward_context
        self.backward_context = backward_context
        self.activation_dtype = activation_dtype
        self.chunk_done = chunk_done
        # Per step; kept as attributes so tests and benchmarks can read them.
        self.peak_stashed = 0
        self.events: list[StepEvent] = []

    @property
    def last_rank_global(self) -> int:
        """Global rank of the pipeline rank that computes the loss."""
        return self.peers[self.pp - 1]

    @property
    def wait_seconds(self) -> float:
        """Seconds the last step spent blocked on communication: in the ``wait()`` of each
        batch's receives and of the sends completed after it (on CUDA, the time the
        current stream was held up there; see :class:`StepClock`). With
        :attr:`step_seconds` it gives the measured idle fraction, ``wait / step``."""
        return self._wire.clock.wait_seconds

    @property
    def step_seconds(self) -> float:
        """Seconds of the last step (``train_step`` or ``eval_step``; on CUDA, on the
        device's timeline)."""
        return self._wire.clock.step_seconds

    def _plan(self, schedule: Schedule) -> Plan:
        """This rank's batches, release points and chunk ends of ``schedule``, computed once."""
        key = (schedule.name, schedule.microbatches, schedule.forward_only)
        if key not in self._plans:
            batches = p2p_plan(schedule)[self.rank]
            last_backward = {
                action.chunk: index
                for index, action in enumerate(schedule.actions[self.rank])
                if action.kind == "B"
            }
            chunk_ends = {index: chunk for chunk, index in last_backward.items()}
            self._plans[key] = batches, release_points(schedule, self.rank), chunk_ends
        return self._plans[key]

    # ---- steps ----------------------------------------------------------------------------

    def train_step(
        self,
        inputs: list[Tensor],
        targets: list[Tensor],
        loss_scale: float = 1.0,
        scale_loss: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        Args:
            inputs: Per micro-batch token ids ``(b, T)`` (read on the first stage).
            targets: Per micro-batch targets ``(b, T)`` (read on the last stage).
            loss_scale: Each micro-batch loss is multiplied by this before backward
                (``1 / (microbatches * accumulation)`` for the batch mean).
            scale_loss: A further loss scaling for backward (FP16's loss scaler).

        Returns:
            The mean of the micro-batch losses on the last rank, None on the others.
        """
        return self._run(self.train_schedule, inputs, targets, loss_scale, scale_loss)

    @torch.no_grad()
    def eval_step(self, inputs: list[Tensor], targets: list[Tensor]) -> Tensor | None:
        """Forward-only schedule over any number of equal micro-batches.

        Returns:
            The mean micro-batch loss on the last rank, None on the others.
        """
        schedule = forward_only(self.pp, self.vpp, len(inputs))
        return self._run(schedule, inputs, targets, 1.0, None)

    def _run(
        self,
        schedule: Schedule,
        inputs: list[Tensor],
        targets: list[Tensor],
        loss_scale: float,
        scale_loss: Callable[[Tensor], Tensor] | None,
    ) -> Tensor | None:
        if len(inputs) != schedule.microbatches:
            raise ValueError(
                f"The {schedule.name} schedule runs {schedule.microbatches} micro-batches, got"
                f" {len(inputs)}."
            )
        wire = self._wire
        wire.start_step(schedule.microbatches)
        b, seq_len = inputs[0].shape
        shape = (b, seq_len // self.seq_divisor, self.hidden_size)
        device = inputs[0].device
        wire.clock.start(device)
        training = not schedule.forward_only
        stash: dict[tuple[int, int], tuple[Tensor | None, Tensor, Tensor | None]] = {}
        losses: list[Tensor] = []
        self.peak_stashed, self.events = 0, []
        batches, releases, chunk_ends = self._plan(schedule)
        try:
            for index, action in enumerate(schedule.actions[self.rank]):
                wire.post(batches[index], shape, device)  # the last send, this input
                self._note(action.kind, action.chunk, action.microbatch)
                if action.kind == "F":
                    self._forward(action, inputs, targets, seq_len, training, stash, losses)
                    self.peak_stashed = max(self.peak_stashed, len(stash))
                else:
                    self._backward(action, stash, loss_scale, scale_loss)
                if index in chunk_ends and self.chunk_done is not None:
                    self._note("R", action.chunk, None)
                    self.chunk_done(action.chunk)
                wire.release(releases.get(index, []))
            wire.post(batches[-1], shape, device)
        finally:
            wire.release(list(wire.sends))
            wire.clock.stop()
        if not losses:
            return None
        return torch.stack(losses).mean()

    def _note(self, kind: Literal["F", "B", "R"], chunk: int, microbatch: int | None) -> None:
        self.events.append(StepEvent(kind, chunk, microbatch, time.perf_counter()))

    def _forward(
        self,
        action: Action,
        inputs: list[Tensor],
        targets: list[Tensor],
        seq_len: int,
        training: bool,
        stash: dict,
        losses: list[Tensor],
    ) -> None:
        stage = self.stages[action.chunk]
        mb = action.microbatch
        if stage.is_first:
            x = inputs[mb]
        else:
            x = self._wire.inbox.pop(("F", stage.index - 1, mb))
            if self.activation_dtype is not None:  # the wire may carry another dtype
                x = x.to(self.activation_dtype)
            x.requires_grad_(training)
        with self.record_range("forward"), self.forward_context():
            out = stage(x, seq_len)
            if stage.is_last:
                out = self.loss_fn(out, targets[mb])
        if stage.is_last:
            losses.append(out.detach().float())
        else:
            self._wire.outbox[("F", stage.index, mb)] = out
        if training:
            aux = stage.model.take_aux_loss() if isinstance(stage.model, HasAuxiliaryLoss) else None
            stash[(action.chunk, mb)] = (None if stage.is_first else x, out, aux)

    def _backward(
        self,
        action: Action,
        stash: dict,
        loss_scale: float,
        scale_loss: Callable[[Tensor], Tensor] | None,
    ) -> None:
        stage = self.stages[action.chunk]
        mb = action.microbatch
        x, out, aux = stash.pop((action.chunk, mb))
        with self.record_range("backward"), self.backward_context():
            if stage.is_last:
                loss = out if aux is None else out + aux
                torch.autograd.backward(_scaled(loss, loss_scale, scale_loss))
            else:
                grad = self._wire.inbox.pop(("B", stage.index + 1, mb))
                outputs, grads = [out], [grad.to(out.dtype)]
                if aux is not None:  # this chunk's share of the loss, scaled alike
                    outputs.append(_scaled(aux, loss_scale, scale_loss))
                    grads.append(None)
                torch.autograd.backward(outputs, grads)
                self._wire.reuse(grad)
        if x is not None:
            assert x.grad is not None
            self._wire.outbox[("B", stage.index, mb)] = x.grad
        del x, out, aux  # the activations of this micro-batch and chunk are free now


def _scaled(
    loss: Tensor, loss_scale: float, scale_loss: Callable[[Tensor], Tensor] | None
) -> Tensor:
    """A micro-batch's loss (term) as backward takes it: times ``loss_scale``, then through
    the precision plugin's loss scaler, if any."""
    loss = loss * loss_scale
    return scale_loss(loss) if scale_loss is not None else loss
