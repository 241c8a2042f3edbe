"""Throughput (and, on accelerators with known peak FLOP/s, MFU) logging."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import ThroughputMonitor


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

    Logs ``train|validate/{batches,samples,items}_per_sec`` (items are tokens for language
    models) and, when the module exposes ``flops_per_batch`` and the device's peak FLOP/s
    is known (CUDA), ``.../mfu``. Keeping Lightning's class means its dtype-aware peak
    FLOP/s lookup and per-device/global split keep working under every strategy.
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
