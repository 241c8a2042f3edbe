"""StepStatsMonitor: the health of each optimizer step (gradient norm, loss scale, memory)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.core.contracts import GradientLayoutProvider, default_gradient_layout
from plugintrain.core.lightning_seam import logs_this_step
from plugintrain.precision_plugins import FP16MixedPrecision

GRAD_NORM = "grad_norm"
LOSS_SCALE = "loss_scale"
PEAK_MEMORY = "memory/peak_bytes"


class StepStatsMonitor(Callback):
    """Log, on the steps the trainer logs (``log_every_n_steps``):

    - ``grad_norm``: the global L2 norm of the gradients the optimizer is about to step,
      before clipping, over every shard, stage and replica (the strategy's
      :class:`~plugintrain.core.contracts.GradientLayoutProvider`), the norm
      ``torch.nn.utils.clip_grad_norm_`` would return in one process; ``inf``/``nan`` on a
      step that FP16 skips for overflow.
    - ``loss_scale``: the loss scale this step's backward used (``16-mixed``); it halves
      on an overflowing step and grows after clean ones.
    - ``memory/peak_bytes``: the most bytes the CUDA caching allocator held for tensors
      during the batch (``torch.cuda.max_memory_allocated``, reset each batch), this rank.
      Not logged on CPU, where nothing cheap counts every tensor
      (:class:`plugintrain.core.memory.LiveTensorMemory` does, at a cost fit for tests).

    The norm costs a pass over the gradients and one small all-reduce on logging steps.

    Args:
        grad_norm: Log ``grad_norm``.
        memory: Log ``memory/peak_bytes`` on CUDA.
    """

    def __init__(self, grad_norm: bool = True, memory: bool = True) -> None:
        self.grad_norm = grad_norm
        self.memory = memory

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tracks_memory(trainer):
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Same condition on every rank (a step count), so the norm's collective matches.
        if not logs_this_step(trainer):
            return
        if self.grad_norm:
            pl_module.log(GRAD_NORM, _global_grad_norm(trainer, optimizer), on_step=True)
        scale = loss_scale(trainer.precision_plugin)
        if scale is not None:
            pl_module.log(LOSS_SCALE, scale, on_step=True)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._tracks_memory(trainer) and logs_this_step(trainer):
            peak = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
            pl_module.log(PEAK_MEMORY, float(peak), on_step=True)

    def _tracks_memory(self, trainer: pl.Trainer) -> bool:
        return self.memory and trainer.strategy.root_device.type == "cuda"


def loss_scale(precision_plugin: Any) -> float | None:
    """The current FP16 loss scale of plugintrain's or Lightning's plugin; None without one."""
    if isinstance(precision_plugin, FP16MixedPrecision):
        return float(precision_plugin.loss_scaler.scale)
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        return float(precision_plugin.scaler.get_scale())
    return None


def _global_grad_norm(trainer: pl.Trainer, optimizer: Optimizer) -> torch.Tensor:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strategy = trainer.strategy
    if isinstance(strategy, GradientLayoutProvider):
        layout = strategy.gradient_layout(params)
    else:
        layout = default_gradient_layout(params)
    return layout.global_norm().detach().float()
