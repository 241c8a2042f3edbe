"""What one rank measures in a benchmark run: step times, tokens, memory, state bytes, loss.

:class:`BenchRecorder` is a callback, so ``plugintrain fit`` benchmarks itself: the run is
the user's run (strategy, precision plugin, logger and throughput callbacks all active)
with the recorder added. Each rank writes ``rank<N>.json`` into ``out_dir``; the bench
tool merges them (:func:`plugintrain.bench.report.merge_ranks`), so no collective is added
to the measured run. The baselines (:mod:`plugintrain.bench.baselines`) write the same
file through :class:`RankRecord`.

Memory: on CUDA the allocator's peak over the timed steps; elsewhere one extra step after
them runs under :class:`~plugintrain.core.memory.LiveTensorMemory`, which sees every tensor
(the timed steps run without it: a dispatch mode slows every operator).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.callbacks.throughput import _data_parallel_replicas
from plugintrain.core.contracts import HoldsGradients
from plugintrain.core.lightning_seam import compute_dtype
from plugintrain.core.memory import LiveTensorMemory, storage_bytes
from plugintrain.core.peak_flops import device_peak_flops
from plugintrain.core.profiling import device_seconds


@dataclass
class RankRecord:
    """One rank's measurements, as written to ``rank<N>.json``."""

    rank: int
    world_size: int
    replicas: int
    """Data-parallel replicas (ranks that read different batches)."""
    device: str
    tokens_per_step: int = 0
    """Tokens of one optimizer step on this rank's replica (micro-batches x B x T)."""
    step_seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    peak_source: str = ""
    """``cuda.max_memory_allocated`` or ``LiveTensorMemory`` (one extra step)."""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    loss: float | None = None
    """This rank's training loss of the last timed step (its micro-batches' mean)."""
    flops_per_token: int | None = None
    peak_flops: float | None = None
    """The device's dense peak FLOP/s in the run's compute dtype, where known."""

    def write(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank{self.rank}.json").write_text(json.dumps(asdict(self)))


def optimizer_tensors(optimizers: list[Optimizer]) -> list[Tensor]:
    """Every tensor of the optimizers' state (torch's ZeroRedundancyOptimizer: its shard's)."""
    tensors = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if torch.is_tensor(v))
    return tensors


def _gradient_tensors(trainer: Trainer, module: torch.nn.Module) -> list[Tensor]:
    """Gradient storage this rank holds: the strategy's buffers where it keeps them apart
    (plugintrain's gradient engine), the parameters' ``.grad`` otherwise."""
    if isinstance(trainer.strategy, HoldsGradients):
        return trainer.strategy.gradient_buffers()
    return [p.grad for p in module.parameters() if p.grad is not None]


@runtime_checkable
class CountsFlops(Protocol):
    """A LightningModule that sets the training FLOPs of its latest batch (as Lightning's
    ``ThroughputMonitor`` reads them; ``CausalLM`` does, LoRA's savings included)."""

    flops_per_batch: int


class BenchRecorder(Callback):
    """Time the optimizer steps after ``warmup``, then measure one more for memory.

    A step is timed from its first micro-batch's ``on_train_batch_start`` to the next
    step's: the whole loop (data, forward, backward, optimizer, callbacks, logging), as the
    baselines time a hand-written loop from one iteration to the next. The last step
    (``max_steps - 1``) is never timed: on CUDA the allocator's peak over the timed steps
    is read as it starts; elsewhere it runs under LiveTensorMemory.

    Args:
        out_dir: Directory for this rank's ``rank<N>.json``.
        warmup: Untimed first optimizer steps.
    """

    def __init__(self, out_dir: str, warmup: int = 2) -> None:
        self.out_dir = Path(out_dir)
        self.warmup = warmup
        self._record: RankRecord | None = None
        self._step_start: float | None = None
        self._step_loss = 0.0
        self._memory: LiveTensorMemory | None = None
        self._cuda_peak = 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        dtype = compute_dtype(trainer.precision_plugin)
        self._record = RankRecord(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            replicas=_data_parallel_replicas(trainer),
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            peak_flops=device_peak_flops(device, dtype),
        )

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return  # not a step's first micro-batch
        record, device, step = self._record, trainer.strategy.root_device, trainer.global_step
        assert record is not None
        if step == self.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        now = device_seconds(device)
        if self._step_start is not None and step - 1 >= self.warmup:
            record.step_seconds.append(now - self._step_start)
        self._step_start = now
        if step == trainer.max_steps - 1:
            self._measure(trainer, pl_module, record)

    def _measure(self, trainer: Trainer, pl_module: LightningModule, record: RankRecord) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            record.peak_bytes, record.peak_source = self._cuda_peak, "cuda.max_memory_allocated"
            return
        self._memory = LiveTensorMemory()
        self._memory.track(*_state_tensors(trainer, pl_module))
        self._memory.__enter__()

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        last = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        device = trainer.strategy.root_device
        step = trainer.global_step - int(last)  # a step's last micro-batch has counted it
        if device.type == "cuda" and self.warmup <= step < trainer.max_steps - 1:
            # Read after every micro-batch: `step_stats` resets the allocator's peak as each
            # batch starts, so one read at the end would miss the earlier steps.
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(device))
        # Lightning divides each micro-batch's loss by the accumulation: their sum is the
        # step's mean loss.
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._step_loss += float(loss) if torch.is_tensor(loss) else 0.0
        if not last:
            return
        record = self._record
        assert record is not None
        if self._memory is not None:
            self._memory.__exit__(None, None, None)
            record.peak_bytes, record.peak_source = self._memory.peak_bytes, "LiveTensorMemory"
            self._memory = None
        elif self.warmup <= step < trainer.max_steps - 1:  # the timed steps
            record.loss = self._step_loss
        self._step_loss = 0.0
        tokens = int(batch[0].numel())
        record.tokens_per_step = tokens * trainer.accumulate_grad_batches
        if isinstance(pl_module, CountsFlops) and pl_module.flops_per_batch:
            record.flops_per_token = pl_module.flops_per_batch // tokens

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = self._record
        assert record is not None
        record.param_bytes = storage_bytes(list(pl_module.parameters()))
        record.grad_bytes = storage_bytes(_gradient_tensors(trainer, pl_module))
        record.optimizer_bytes = storage_bytes(optimizer_tensors(trainer.optimizers))
        record.write(self.out_dir)


def _state_tensors(trainer: Trainer, module: torch.nn.Module) -> list[Tensor]:
    """What exists before a step and lives through it (weights, gradients, optimizer state)."""
    return [
        *module.parameters(),
        *module.buffers(),
        *_gradient_tensors(trainer, module),
        *optimizer_tensors(trainer.optimizers),
    ]
