"""Throughput (and, on accelerators with known peak FLOP/s, MFU) logging."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from plugintrain.peak_flops import device_peak_flops


def _samples_in_batch(batch: Any) -> int:
    """Number of samples: the leading dimension of the batch's first tensor."""
    return int(batch[0].size(0))


def _tokens_in_batch(batch: Any) -> int:
    """Tokens for integer (token id) inputs, samples for anything else (e.g. images)."""
    inputs = batch[0]
    if inputs.dtype in (torch.int32, torch.int64) and inputs.dim() >= 2:
        return int(inputs.numel())
    return int(inputs.size(0))


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` set up for ``(inputs, targets)`` batches.

    Training logs ``throughput/{tokens,samples,batches}_per_sec`` (tokens: the samples of
    inputs that are not token ids, e.g. images) over the world, the same per device under
    ``throughput/device/``, and, when the module exposes ``flops_per_batch`` and the
    device's dense peak FLOP/s is known (:mod:`plugintrain.peak_flops`; CUDA),
    ``throughput/mfu`` (a replica's FLOP/s over its devices' peak); the running totals are
    ``throughput/{time,tokens,samples,batches}``. Validation keeps Lightning's names
    (``validate/items_per_sec``, ...). Keeping
    Lightning's class keeps its per-device/global split (and its peak FLOP/s lookup for
    devices the dense table does not cover) working under every strategy.

    Under tensor or pipeline parallelism the ``tp x pp`` ranks of one data-parallel
    replica process the same batch, so global figures count replicas, not ranks, and MFU
    divides a replica's FLOP/s by the peak of all of its devices.
    """

    def __init__(self, window_size: int = 20, separator: str = "/") -> None:
        """Create the monitor.

        Args:
            window_size: Number of batches the rolling averages span.
            separator: Separator between stage prefix and metric name.
        """
        super().__init__(
            batch_size_fn=_samples_in_batch,
            length_fn=_tokens_in_batch,
            window_size=window_size,
            separator=separator,
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # Dense peaks for CUDA devices (plugintrain.peak_flops), Lightning's elsewhere.
        dtype = _plugin_to_compute_dtype(trainer.precision_plugin)
        peak = device_peak_flops(trainer.strategy.root_device, dtype) or self.available_flops
        replicas = _data_parallel_replicas(trainer)
        for throughput in self._throughputs.values():
            throughput.world_size = replicas
            throughput.available_flops = (
                None if peak is None else peak * (trainer.world_size // replicas)
            )

    @override
    def _compute(self, trainer: Trainer, iter_num: int | None = None) -> None:
        # Lightning's, with the training figures under the stable names above.
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        assert stage is not None
        throughput = self._throughputs[stage]
        metrics = throughput.compute()
        if stage == RunningStage.TRAINING:
            metrics = {f"throughput/{_TOKEN_NAMES.get(k, k)}": v for k, v in metrics.items()}
        else:
            metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in metrics.items()}
        trainer._logger_connector.log_metrics(metrics, step=iter_num)  # type: ignore[arg-type]


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
