"""The pipeline runtime: what a strategy holds, and delegates its steps to, when pp > 1.

With pipeline parallelism the strategy owns the training step instead of Lightning's loop.
:class:`PipelineRuntime` cuts each batch into micro-batches, runs the schedule with the
:class:`~plugintrain.strategies.pipeline_executor.PipelineExecutor` inside the precision
plugin's autocast, broadcasts the loss from the last stage so every rank logs it, runs
validation and test as forward-only schedules, and starts reducing each chunk's gradients
over dp as soon as they are final (:func:`chunk_partition`). A strategy holds ``None`` (no
pipeline) or one runtime; the runtime needs only the
:class:`~plugintrain.core.contracts.ParallelModule` contract of the module.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from plugintrain.core import profiling
from plugintrain.core.contracts import ModelShape, ParallelModule, StagedModel, check_contract
from plugintrain.precision_plugins import precision_dtypes
from plugintrain.strategies.engine_binding import EngineBinding
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_executor import PipelineExecutor
from plugintrain.strategies.pipeline_stages import (
    PipelineOptions,
    VirtualStage,
    check_layers,
    split_model,
)
from plugintrain.strategies.tied import TiedParameters

TIED: Hashable = "tied"
"""The :func:`chunk_partition` key of weights tied across stages."""


def check_pipeline(
    config: ModelShape, dims: ParallelDims, options: PipelineOptions, batch_size: Any = None
) -> None:
    """Raise unless the model's layers split into pp x vpp stages and ``batch_size`` (the
    per-rank batch, when known) into ``options.microbatches`` equal micro-batches."""
    check_layers(
        config.n_layer,
        dims.pipeline_parallel,
        dims.virtual_pipeline_parallel,
        options.layers_per_stage,
    )
    if isinstance(batch_size, int) and batch_size % options.microbatches:
        raise ValueError(
            f"The per-rank batch_size={batch_size} does not split into microbatches="
            f"{options.microbatches} equal micro-batches; choose a batch size that is a"
            f" multiple of {options.microbatches}, or other microbatches."
        )


def split_stages(
    module: ParallelModule, dims: ParallelDims, options: PipelineOptions, mesh: DeviceMesh
) -> list[VirtualStage]:
    """Cut ``module.model`` down to this pipeline rank's virtual stages, in place."""
    check_contract(module.model, StagedModel, f"pipeline_parallel={dims.pipeline_parallel}")
    return split_model(
        module.model,
        mesh["pp"].get_local_rank(),
        dims.pipeline_parallel,
        dims.virtual_pipeline_parallel,
        options.layers_per_stage,
    )


def chunk_partition(
    module: ParallelModule, stages: list[VirtualStage], tied: TiedParameters
) -> dict[str, Hashable]:
    """Each trainable parameter's name -> the chunk (index into ``stages``) whose backward
    produces its gradient, or :data:`TIED` for a weight tied across stages.

    A block's parameters belong to the chunk that runs the block; the others (the
    embedding on the first stage, the final norm and head on the last) to the rank's
    first or last stage, the one chunk that runs them (with pp > 1 no rank holds both).
    Given to the gradient engine as its ``partition``.
    """
    owner: dict[int, int] = {}
    for chunk, stage in enumerate(stages):
        for key in stage.layer_keys:
            owner.update((id(p), chunk) for p in stage.model.layers[key].parameters())
    ends = [chunk for chunk, stage in enumerate(stages) if stage.is_first or stage.is_last]
    rest = ends[0] if ends else 0
    tied_names = {name for pair in tied.pairs for name in pair}
    return {
        name: TIED if name in tied_names else owner.get(id(p), rest)
        for name, p in module.named_parameters()
        if p.requires_grad
    }


class PipelineRuntime:
    """Runs one pipeline rank's schedules for a strategy.

    Args:
        module: The LightningModule, already split into ``stages`` (and sharded by tp).
        stages: This rank's virtual stages, from :func:`split_stages`.
        dims: The layout.
        options: Schedule, micro-batches, wire dtype.
        mesh: The ``("pp", "dp", "tp")`` mesh.
        precision_plugin: Its ``forward_context`` wraps each forward; its ``loss_scaler``
            (FP16) scales the loss on the last stage.
        global_rank: This process's rank.
    """

    def __init__(
        self,
        module: ParallelModule,
        stages: list[VirtualStage],
        dims: ParallelDims,
        options: PipelineOptions,
        mesh: DeviceMesh,
        precision_plugin: Precision,
        global_rank: int,
    ) -> None:
        self.module = module
        self.microbatches = options.microbatches
        self.precision_plugin = precision_plugin
        self.tied = TiedParameters.of(module)
        self.tied.join_stages(module, mesh, global_rank)
        self._engine: GradientEngine | None = None
        self._chunk_params = _chunk_parameters(module, chunk_partition(module, stages, self.tied))
        dtypes = precision_dtypes(precision_plugin)
        self.executor = PipelineExecutor(
            stages,
            options.schedule,
            dims.pipeline_parallel,
            dims.virtual_pipeline_parallel,
            options.microbatches,
            rank=mesh["pp"].get_local_rank(),
            group=mesh["pp"].get_group(),
            # Late-bound: under tp the strategy has wrapped the module's loss_fn.
            loss_fn=lambda logits, targets: module.loss_fn(logits, targets),
            hidden_size=module.config.n_embd,
            # Each rank's activations: its cp share of the rows, split over tp under SP.
            seq_divisor=dims.cp * (dims.tensor_parallel if dims.sequence_parallel else 1),
            wire_dtype=options.wire_dtype or dtypes.compute,
            forward_context=precision_plugin.forward_context,
            backward_context=loss_parallel if dims.tp_enabled else nullcontext,
            record_range=profiling.record,
            activation_dtype=dtypes.params,
            chunk_done=self._reduce_chunk,
        )

    def training_step(self, batch: Any, engine: GradientEngine, accumulate: int) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; returns the batch loss.

        Gradients accumulate in ``engine``'s buffers; each chunk's start reducing as soon as
        its last backward has run (except under gradient accumulation, where the engine
        waits for the last batch), and :meth:`finish_gradients` completes the reduction.

        Args:
            batch: ``(x, y)``, or ``(x, y, positions)`` of packed rows: this rank's whole
                batch.
            engine: The data-parallel gradient engine.
            accumulate: Lightning's ``accumulate_grad_batches`` (scales each loss).
        """
        inputs, targets, positions = _microbatches(batch, self.microbatches)
        scaler = getattr(self.precision_plugin, "loss_scaler", None)
        self._engine = engine
        with engine.defer_reduction():
            loss = self.executor.train_step(
                inputs,
                targets,
                loss_scale=1.0 / (self.microbatches * accumulate),
                scale_loss=scaler.scale_loss if scaler is not None else None,
                positions=positions,
            )
        loss = self._broadcast_loss(loss, batch[0].device)
        self._share_statistics(batch[0].device)
        self.module.record_loss("train", loss, batch)
        return loss

    def evaluate(self, stage: str, batch: Any) -> None:
        """A forward-only schedule over ``batch``; logs the loss for ``stage``."""
        # Rows that go together (a preference pair's two) never part: count in samples.
        unit = getattr(self.module, "rows_per_sample", 1)
        count = math.gcd(batch[0].size(0) // unit, self.microbatches)
        inputs, targets, positions = _microbatches(batch, count)
        loss = self.executor.eval_step(inputs, targets, positions)
        loss = self._broadcast_loss(loss, batch[0].device)
        self._share_statistics(batch[0].device)
        self.module.record_loss(stage, loss, batch)

    def backward(self, closure_loss: Tensor, binding: EngineBinding) -> None:
        """The precision plugin's part of Lightning's backward: the schedule already ran
        backward inside :meth:`training_step`, accumulating into the engine's buffers, and
        Lightning zeroes the optimizer's gradients in between, so the reduction that exposes
        them to the optimizer happens here (at the last batch of gradient accumulation)."""
        plugin = self.precision_plugin
        plugin.pre_backward(closure_loss, self.module)
        if not binding.accumulating:
            self.finish_gradients(binding.engine)
        plugin.post_backward(closure_loss, self.module)

    def finish_gradients(self, engine: GradientEngine) -> None:
        """Sum tied weights' gradients over the first and last stage, then finish reducing
        over dp (the chunks' buckets are on their way already)."""
        self.tied.sum_gradients(engine)
        engine.finish_grad_sync()

    def _reduce_chunk(self, chunk: int) -> None:
        """Start reducing ``chunk``'s buckets: the executor has run its last backward."""
        if self._engine is not None:
            self._engine.launch(self._chunk_params.get(chunk, []))  # a chunk may train nothing

    def _share_statistics(self, device: torch.device) -> None:
        """A module that keeps statistics of its loss (``statistics_vector``: a fixed-size
        float vector, computed on the last stage, zeros elsewhere) gets the last stage's
        on every rank of the pipeline (``receive_statistics``), so that every rank logs the
        same keys and values (a synchronized log is a collective every rank must join)."""
        share = getattr(self.module, "statistics_vector", None)
        if not callable(share):
            return
        vector = share(device).detach().float().contiguous()
        dist.broadcast(vector, src=self.executor.last_rank_global, group=self.executor.group)
        self.module.receive_statistics(vector)

    def _broadcast_loss(self, loss: Tensor | None, device: torch.device) -> Tensor:
        """The last stage's loss on every rank of the pipeline (zeros stand in elsewhere)."""
        value = loss if loss is not None else torch.zeros((), device=device)
        value = value.detach().float().contiguous()
        executor = self.executor
        dist.broadcast(value, src=executor.last_rank_global, group=executor.group)
        return value


def _chunk_parameters(
    module: ParallelModule, partition: dict[str, Hashable]
) -> dict[int, list[Tensor]]:
    """The trainable parameters of each chunk (tied weights excluded), by chunk index."""
    chunks: dict[int, list[Tensor]] = {}
    for name, param in module.named_parameters():
        chunk = partition.get(name, TIED)
        if isinstance(chunk, int):
            chunks.setdefault(chunk, []).append(param)
    return chunks


def _microbatches(batch: Any, count: int) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
    """``count`` micro-batches of inputs, targets and, for packed rows, positions."""
    x, y, *rest = batch
    if x.size(0) % count:
        raise ValueError(
            f"A batch of {x.size(0)} sequences does not split into microbatches={count};"
            f" use a batch size that is a multiple of {count}."
        )
    positions = list(rest[0].chunk(count)) if rest else None
    return list(x.chunk(count)), list(y.chunk(count)), positions
