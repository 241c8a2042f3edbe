"""Pipeline parallelism: stage splitting and one executor for every schedule.

:func:`split_model` cuts any :class:`~plugintrain.distributed.StagedModel` (the zoo's
``Transformer``, or a new family that implements the protocol) into this rank's virtual
stages in place (torchtitan's layout: the ``layers`` ``ModuleDict`` keeps the full-model
keys of the layers it still holds, and the embedding and head are dropped on the ranks
that do not run the first or last stage), so parameter names, tensor-parallel plans and
checkpoints keep their full-model paths. :class:`PipelineOptions` groups how a pipeline
runs (schedule, micro-batches, uneven stages, wire dtype).

:class:`PipelineExecutor` runs any :class:`~plugintrain.strategies.pipeline_schedules.
Schedule`: each action is the forward or backward of one micro-batch through one chunk;
activations and their gradients travel by ``isend``/``irecv`` with a tag per message,
sends are asynchronous and receives block until needed (so only a cycle of data
dependencies can hang, which the simulator rules out; ``batch_isend_irecv`` is not used,
as it has been reported to hang on gloo in some orders). Every message has a fixed
shape, ``(micro-batch, sequence (/ tp with SP), hidden)``, and a fixed wire dtype, so
bf16 autocast outputs never meet an fp32 receive buffer of another dtype. Activations
are freed as soon as their backward has run, a sent tensor as soon as the schedule
proves it delivered (an answer from its receiver has arrived), and gradients are received
into one reused buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plugintrain.distributed import StagedModel
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_schedules import (
    Action,
    Message,
    Schedule,
    build_schedule,
    forward_only,
    release_points,
)
from plugintrain.strategies.pipeline_schedules import validate as validate_schedule

ContextFactory = Callable[[], AbstractContextManager]


def check_layers(
    n_layer: int, pp: int, vpp: int, layers_per_stage: Sequence[int] | None = None
) -> None:
    """Raise a ``ValueError`` naming the fix unless ``n_layer`` splits into ``pp * vpp`` chunks.

    Args:
        n_layer: Transformer blocks of the model.
        pp: Pipeline ranks.
        vpp: Chunks per rank.
        layers_per_stage: Blocks of each virtual stage, in stage order; None: equal.
    """
    stages = pp * vpp
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
    layers_per_stage: tuple[int, ...] | None = None
    """Blocks of each virtual stage, in stage order; None: equal."""
    wire_dtype: torch.dtype = torch.float32
    """Dtype of the activations and gradients sent between stages."""

    @classmethod
    def resolve(
        cls,
        dims: ParallelDims,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
        wire_dtype: torch.dtype | str = torch.float32,
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
            layers_per_stage=None if layers_per_stage is None else tuple(layers_per_stage),
            wire_dtype=_dtype(wire_dtype),
        )
        if dims.pipeline_parallel > 1:
            validate_schedule(dims.pipeline_parallel, vpp, options.microbatches, options.schedule)
        return options


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"wire_dtype={value!r} is not a torch dtype; use e.g. 'float32'.")
    return dtype


@dataclass
class VirtualStage:
    """One virtual stage of a split :class:`~plugintrain.distributed.StagedModel`: which of
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

    Attributes:
        peak_stashed: Most micro-batch chunks held for backward during the last step.
        wait_seconds: Seconds the last step spent blocked on communication: in the
            ``wait()`` of each receive and of the sends completed at its end. With
            :attr:`step_seconds` it gives the measured idle fraction, ``wait / step``.
        step_seconds: Wall time of the last step (``train_step`` or ``eval_step``).
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
    ) -> None:
        if len(stages) != vpp:
            raise ValueError(f"Rank {rank} got {len(stages)} virtual stages for vpp={vpp}.")
        self.stages = stages
        self.pp, self.vpp, self.rank = pp, vpp, rank
        self.train_schedule = build_schedule(schedule, pp, vpp, microbatches)
        self._releases: dict[tuple, dict[int, list[Message]]] = {}
        self.group = group
        self.peers = dist.get_process_group_ranks(group) if group is not None else list(range(pp))
        self.loss_fn = loss_fn
        self.hidden_size = hidden_size
        self.seq_divisor = seq_divisor
        self.wire_dtype = wire_dtype
        self.forward_context = forward_context
        self.backward_context = backward_context
        # Per step; kept as attributes so tests and benchmarks can read them.
        self.peak_stashed = 0
        self.wait_seconds = 0.0
        self.step_seconds = 0.0
        self._sends: dict[Message, tuple[dist.Work, Tensor]] = {}
        self._grad_buffer: Tensor | None = None
        self._step_microbatches = microbatches

    @property
    def last_rank_global(self) -> int:
        """Global rank of the pipeline rank that computes the loss."""
        return self.peers[self.pp - 1]

    # ---- p2p ------------------------------------------------------------------------------

    def _tag(self, kind: str, stage: int, microbatch: int) -> int:
        """A distinct tag per message of a step: the producing stage, micro-batch, direction."""
        return (stage * self._step_microbatches + microbatch) * 2 + (kind == "B")

    def _send(self, tensor: Tensor, message: Message) -> None:
        kind, stage, _ = message
        peer = self.peers[(stage + 1 if kind == "F" else stage - 1) % self.pp]
        wire = tensor.detach().to(self.wire_dtype).contiguous()
        work = dist.isend(wire, dst=peer, group=self.group, tag=self._tag(*message))
        self._sends[message] = (work, wire)

    def _release(self, messages: list[Message]) -> None:
        """Complete and drop sends that the schedule proves delivered
        (:func:`~plugintrain.strategies.pipeline_schedules.release_points`), so each sent
        tensor is freed as soon as nothing else (the stash) holds it."""
        start = time.perf_counter()
        for message in messages:
            work, _ = self._sends.pop(message)
            work.wait()
        self.wait_seconds += time.perf_counter() - start

    def _recv(
        self,
        shape: tuple[int, ...],
        from_stage: int,
        tag: int,
        device: torch.device,
        reuse: bool = False,
    ) -> Tensor:
        """Receive one message; ``reuse``: into the executor's one gradient buffer, which
        the backward that reads it has finished with before the next receive."""
        peer = self.peers[from_stage % self.pp]
        buffer = self._grad_buffer if reuse else None
        if buffer is None or buffer.shape != shape or buffer.device != device:
            buffer = torch.empty(shape, dtype=self.wire_dtype, device=device)
            self._grad_buffer = buffer if reuse else self._grad_buffer
        work = dist.irecv(buffer, src=peer, group=self.group, tag=tag)
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start
        return buffer

    def _wait_sends(self) -> None:
        self._release(list(self._sends))

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
        start = time.perf_counter()
        self.wait_seconds = 0.0
        self._step_microbatches = schedule.microbatches
        b, seq_len = inputs[0].shape
        shape = (b, seq_len // self.seq_divisor, self.hidden_size)
        device = inputs[0].device
        training = not schedule.forward_only
        stash: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        losses: list[Tensor] = []
        self.peak_stashed = 0
        key = (schedule.name, schedule.microbatches, schedule.forward_only)
        if key not in self._releases:  # the schedule's, computed once
            self._releases[key] = release_points(schedule, self.rank)
        releases = self._releases[key]
        try:
            for index, action in enumerate(schedule.actions[self.rank]):
                if action.kind == "F":
                    self._forward(
                        action, inputs, targets, shape, seq_len, device, training, stash, losses
                    )
                    self.peak_stashed = max(self.peak_stashed, len(stash))
                else:
                    self._backward(action, shape, device, stash, loss_scale, scale_loss)
                self._release(releases.get(index, []))
        finally:
            self._wait_sends()
            self.step_seconds = time.perf_counter() - start
        if not losses:
            return None
        return torch.stack(losses).mean()

    def _forward(
        self,
        action: Action,
        inputs: list[Tensor],
        targets: list[Tensor],
        shape: tuple[int, ...],
        seq_len: int,
        device: torch.device,
        training: bool,
        stash: dict,
        losses: list[Tensor],
    ) -> None:
        stage = self.stages[action.chunk]
        mb = action.microbatch
        if stage.is_first:
            x = inputs[mb]
        else:
            x = self._recv(shape, stage.index - 1, self._tag("F", stage.index - 1, mb), device)
            x.requires_grad_(training)
        with self.forward_context():
            out = stage(x, seq_len)
            if stage.is_last:
                out = self.loss_fn(out, targets[mb])
        if stage.is_last:
            losses.append(out.detach().float())
        else:
            self._send(out, ("F", stage.index, mb))
        if training:
            stash[(action.chunk, mb)] = (None if stage.is_first else x, out)

    def _backward(
        self,
        action: Action,
        shape: tuple[int, ...],
        device: torch.device,
        stash: dict,
        loss_scale: float,
        scale_loss: Callable[[Tensor], Tensor] | None,
    ) -> None:
        stage = self.stages[action.chunk]
        mb = action.microbatch
        x, out = stash.pop((action.chunk, mb))
        with self.backward_context():
            if stage.is_last:
                loss = out * loss_scale
                torch.autograd.backward(scale_loss(loss) if scale_loss is not None else loss)
            else:
                tag = self._tag("B", stage.index + 1, mb)
                grad = self._recv(shape, stage.index + 1, tag, device, reuse=True)
                torch.autograd.backward(out, grad.to(out.dtype))
        if x is not None:
            assert x.grad is not None
            self._send(x.grad, ("B", stage.index, mb))
        del x, out  # the activations of this micro-batch and chunk are free now
