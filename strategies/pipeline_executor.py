"""The pipeline executor: one rank's side of any schedule, action by action.

:class:`PipelineExecutor` runs a :class:`~plugintrain.strategies.pipeline_schedules.
Schedule` on this rank's virtual stages (:mod:`~plugintrain.strategies.pipeline_stages`):
each action is the forward or backward of one micro-batch through one chunk
(:class:`_StageRunner`), and activations and their gradients travel between ranks in the
batches of :func:`~plugintrain.strategies.pipeline_schedules.p2p_plan`, each posted with
one ``batch_isend_irecv`` (:class:`_Wire`), in the order the simulator proves cannot hang.
As soon as a chunk's last backward of a step has run, it is handed over (``chunk_done``)
so its data-parallel reduction overlaps the rest. Each step leaves a log
(:class:`StepEvent`) and its time waiting on transfers (:class:`StepClock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from plugintrain.core.contracts import HasAuxiliaryLoss
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
from plugintrain.strategies.pipeline_stages import VirtualStage

ContextFactory = Callable[[], AbstractContextManager]


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


class _StageRunner:
    """What one action does to one of the rank's chunks.

    A forward takes its input from the batch (first stage) or the wire and leaves its
    output on the wire, or its loss (last stage); a backward takes the output's gradient
    from the wire and leaves the input's there. In between, the activations wait in the
    step's stash, with the chunk's auxiliary loss (:class:`~plugintrain.core.contracts.
    HasAuxiliaryLoss`), which the backward includes, scaled as the loss is. The arguments
    are :class:`PipelineExecutor`'s of the same names; ``wire`` is the rank's traffic.
    """

    def __init__(
        self,
        stages: list[VirtualStage],
        wire: _Wire,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        forward_context: ContextFactory,
        backward_context: ContextFactory,
        record_range: Callable[[str], AbstractContextManager],
        activation_dtype: torch.dtype | None,
    ) -> None:
        self.stages = stages
        self.wire = wire
        self.loss_fn = loss_fn
        self.forward_context = forward_context
        self.backward_context = backward_context
        self.record_range = record_range
        self.activation_dtype = activation_dtype

    def forward(
        self,
        action: Action,
        inputs: list[Tensor],
        targets: list[Tensor],
        seq_len: int,
        training: bool,
        stash: dict,
        losses: list[Tensor],
        positions: list[Tensor] | None = None,
    ) -> None:
        stage = self.stages[action.chunk]
        mb = action.microbatch
        if stage.is_first:
            x = inputs[mb]
        else:
            x = self.wire.inbox.pop(("F", stage.index - 1, mb))
            if self.activation_dtype is not None:  # the wire may carry another dtype
                x = x.to(self.activation_dtype)
            x.requires_grad_(training)
        with self.record_range("forward"), self.forward_context():
            out = stage(x, seq_len, None if positions is None else positions[mb])
            if stage.is_last:
                out = self.loss_fn(out, targets[mb])
        if stage.is_last:
            losses.append(out.detach().float())
        else:
            self.wire.outbox[("F", stage.index, mb)] = out
        if training:
            aux = stage.model.take_aux_loss() if isinstance(stage.model, HasAuxiliaryLoss) else None
            stash[(action.chunk, mb)] = (None if stage.is_first else x, out, aux)

    def backward(
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
                grad = self.wire.inbox.pop(("B", stage.index + 1, mb))
                outputs, grads = [out], [grad.to(out.dtype)]
                if aux is not None:  # this chunk's share of the loss, scaled alike
                    outputs.append(_scaled(aux, loss_scale, scale_loss))
                    grads.append(None)
                torch.autograd.backward(outputs, grads)
                self.wire.reuse(grad)
        if x is not None:
            assert x.grad is not None
            self.wire.outbox[("B", stage.index, mb)] = x.grad
        del x, out, aux  # the activations of this micro-batch and chunk are free now


class PipelineExecutor:
    """Runs a schedule's actions for one pipeline rank.

    Args:
        stages: This rank's virtual stages, in chunk order (from
            :func:`~plugintrain.strategies.pipeline_stages.split_model`).
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
        self.pp, self.vpp, self.rank = pp, vpp, rank
        self.train_schedule = build_schedule(schedule, pp, vpp, microbatches)
        self._plans: dict[tuple, Plan] = {}
        self.group = group
        self.peers = dist.get_process_group_ranks(group) if group is not None else list(range(pp))
        self._wire = _Wire(self.peers, group, wire_dtype, record_range)
        self._runner = _StageRunner(
            stages,
            self._wire,
            loss_fn,
            forward_context,
            backward_context,
            record_range,
            activation_dtype,
        )
        self.hidden_size = hidden_size
        self.seq_divisor = seq_divisor
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
        positions: list[Tensor] | None = None,
    ) -> Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        Args:
            inputs: Per micro-batch token ids ``(b, T)`` (read on the first stage).
            targets: Per micro-batch targets ``(b, T)`` (read on the last stage).
            loss_scale: Each micro-batch loss is multiplied by this before backward
                (``1 / (microbatches * accumulation)`` for the batch mean).
            scale_loss: A further loss scaling for backward (FP16's loss scaler).
            positions: Per micro-batch ``(b, T)`` positions of packed rows (read on every
                stage, which masks attention at their example boundaries); None: unpacked.

        Returns:
            The mean of the micro-batch losses on the last rank, None on the others.
        """
        return self._run(self.train_schedule, inputs, targets, loss_scale, scale_loss, positions)

    @torch.no_grad()
    def eval_step(
        self,
        inputs: list[Tensor],
        targets: list[Tensor],
        positions: list[Tensor] | None = None,
    ) -> Tensor | None:
        """Forward-only schedule over any number of equal micro-batches (``positions`` as in
        :meth:`train_step`).

        Returns:
            The mean micro-batch loss on the last rank, None on the others.
        """
        schedule = forward_only(self.pp, self.vpp, len(inputs))
        return self._run(schedule, inputs, targets, 1.0, None, positions)

    def _run(
        self,
        schedule: Schedule,
        inputs: list[Tensor],
        targets: list[Tensor],
        loss_scale: float,
        scale_loss: Callable[[Tensor], Tensor] | None,
        positions: list[Tensor] | None = None,
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
                    self._runner.forward(
                        action, inputs, targets, seq_len, training, stash, losses, positions
                    )
                    self.peak_stashed = max(self.peak_stashed, len(stash))
                else:
                    self._runner.backward(action, stash, loss_scale, scale_loss)
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


def _scaled(
    loss: Tensor, loss_scale: float, scale_loss: Callable[[Tensor], Tensor] | None
) -> Tensor:
    """A micro-batch's loss (term) as backward takes it: times ``loss_scale``, then through
    the precision plugin's loss scaler, if any."""
    loss = loss * loss_scale
    return scale_loss(loss) if scale_loss is not None else loss
