"""Throughput (and, on accelerators with known peak FLOP/s, MFU) logging.

The figures are rates between two instants, and on CUDA an instant is only meaningful
after ``torch.cuda.synchronize`` (the host runs ahead of the device). Lightning's monitor
synchronizes after every batch, which stalls the host's queue of kernels once per step;
:class:`TokenThroughputMonitor` counts every batch but synchronizes and reads the clock
only on the batches whose figures get logged.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from plugintrain.core.lightning_seam import accumulating, compute_dtype, log_metrics, logs_this_step
from plugintrain.core.peak_flops import device_peak_flops


def _samples_in_batch(batch: Any) -> int:
    """Number of samples: the leading dimension of the batch's first tensor (a batch that
    says its own size, a rollout's: its ``samples``)."""
    if hasattr(batch, "samples"):
        return int(batch.samples)
    return int(batch[0].size(0))


def _tokens_in_batch(batch: Any) -> int:
    """Tokens for integer (token id) inputs, samples for anything else (e.g. images); a
    batch that says its own size (a rollout's): its ``tokens``."""
    if hasattr(batch, "tokens"):
        return int(batch.tokens)
    inputs = batch[0]
    if inputs.dtype in (torch.int32, torch.int64) and inputs.dim() >= 2:
        return int(inputs.numel())
    return int(inputs.size(0))


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` set up for ``(inputs, targets)`` batches.

    Training logs ``throughput/{tokens,samples,batches}_per_sec`` (tokens: the samples of
    inputs that are not token ids, e.g. images) over the world, the same per device under
    ``throughput/device/``, and, when the module exposes ``flops_per_batch`` and the
    device's dense peak FLOP/s is known (:mod:`plugintrain.core.peak_flops`; CUDA),
    ``throughput/mfu`` (a replica's FLOP/s over its devices' peak); the running totals are
    ``throughput/{time,tokens,samples,batches}``. Validation keeps Lightning's names
    (``validate/items_per_sec``, ...). Keeping
    Lightning's class keeps its per-device/global split (and its peak FLOP/s lookup for
    devices the dense table does not cover) working under every strategy.

    Every batch is counted, but the device is synchronized and the clock read only on the
    batches whose figures are logged (every ``trainer.log_every_n_steps`` optimizer steps):
    a rate is the tokens (samples, FLOPs) between two logged points over the time between
    them. Validation inside ``fit`` runs between a synchronized start and end, and its
    time is left out of the training time.

    Under tensor or pipeline parallelism the ``tp x pp`` ranks of one data-parallel
    replica process the same batch, so global figures count replicas, not ranks, and MFU
    divides a replica's FLOP/s by the peak of all of its devices.
    """

    def __init__(self, window_size: int = 20, separator: str = "/") -> None:
        """Create the monitor.

        Args:
            window_size: Steps the rolling averages span, at least: the window holds the
                fewest logged points that cover ``window_size - 1`` steps (Lightning's
                ``window_size`` timed batches when logging every step).
            separator: Separator between stage prefix and metric name.
        """
        super().__init__(
            batch_size_fn=_samples_in_batch,
            length_fn=_tokens_in_batch,
            window_size=window_size,
            separator=separator,
        )
        self.window_size = window_size
        self._flops_since: dict[RunningStage, int] = {}  # FLOPs since the last timed point

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.kwargs["window_size"] = _timed_points(self.window_size, trainer.log_every_n_steps)
        super().setup(trainer, pl_module, stage)
        # Dense peaks for CUDA devices (plugintrain.core.peak_flops), Lightning's elsewhere.
        dtype = compute_dtype(trainer.precision_plugin)
        peak = device_peak_flops(trainer.strategy.root_device, dtype) or self.available_flops
        replicas = _data_parallel_replicas(trainer)
        for throughput in self._throughputs.values():
            throughput.world_size = replicas
            throughput.available_flops = (
                None if peak is None else peak * (trainer.world_size // replicas)
            )

    @override
    def _start(self, trainer: Trainer) -> None:
        super()._start(trainer)
        self._flops_since[trainer.state.stage] = 0

    @override
    def _update(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, iter_num: int
    ) -> None:
        # Lightning's, timing only the batches `_compute` logs.
        stage = trainer.state.stage
        self._lengths[stage] += _tokens_in_batch(batch)
        self._samples[stage] += _samples_in_batch(batch)
        self._batches[stage] += 1
        # Lightning's contract: the module may set `flops_per_batch` for each batch.
        flops = getattr(pl_module, "flops_per_batch", None)
        self._flops_since[stage] += flops or 0
        if not _logs_now(trainer):
            return
        _synchronize(trainer.strategy.root_device)
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage],
            flops=None if flops is None else self._flops_since[stage],
        )
        self._flops_since[stage] = 0

    @override
    def _compute(self, trainer: Trainer, iter_num: int | None = None) -> None:
        # Lightning's, with the training figures under the stable names above.
        if not logs_this_step(trainer):
            return
        stage = trainer.state.stage
        assert stage is not None
        throughput = self._throughputs[stage]
        metrics = throughput.compute()
        if stage == RunningStage.TRAINING:
            metrics = {f"throughput/{_TOKEN_NAMES.get(k, k)}": v for k, v in metrics.items()}
        else:
            metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in metrics.items()}
        log_metrics(trainer, metrics, step=iter_num)

    @override
    @rank_zero_only
    def on_validation_start(self, trainer: Trainer, *_: Any) -> None:
        if trainer.sanity_checking:
            return
        _synchronize(trainer.strategy.root_device)  # training's queued work counts as training
        super().on_validation_start(trainer)

    @override
    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, *_: Any) -> None:
        # Replaces Lightning's, which measures from the last *timed* training batch and so
        # would also leave out the untimed batches since then.
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        _synchronize(trainer.strategy.root_device)
        validation = time.perf_counter() - self._t0s[RunningStage.VALIDATING]
        self._t0s[RunningStage.TRAINING] += validation


# Lightning's "items" are tokens here (see _tokens_in_batch).
_TOKEN_NAMES = {
    "items_per_sec": "tokens_per_sec",
    "device/items_per_sec": "device/tokens_per_sec",
    "lengths": "tokens",
    # Lightning's per-device MFU: FLOP/s of a data-parallel replica over the peak of its
    # tp x pp devices (see setup), which is the MFU of the whole run.
    "device/mfu": "mfu",
}


def _data_parallel_replicas(trainer: Trainer) -> int:
    """Ranks that read different batches (the strategy's sampler replicas)."""
    try:
        kwargs = trainer.strategy.distributed_sampler_kwargs
    except (AttributeError, RuntimeError):  # a single-device strategy, or no mesh yet
        return trainer.world_size
    return int((kwargs or {}).get("num_replicas", trainer.world_size))


def _timed_points(window_size: int, log_every_n_steps: int) -> int:
    """Logged points a rolling window holds to span ``window_size - 1`` steps (two at least)."""
    if log_every_n_steps < 1:  # nothing is logged, nothing timed
        return 2
    return 1 + max(1, math.ceil((window_size - 1) / log_every_n_steps))


def _logs_now(trainer: Trainer) -> bool:
    """Whether this batch's figures are logged (``_compute`` runs in training only after a
    step's last micro-batch, so the optimizer step is inside the timed span)."""
    if trainer.state.stage == RunningStage.TRAINING and accumulating(trainer):
        return False
    return logs_this_step(trainer)


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so the clock read next is when it finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
