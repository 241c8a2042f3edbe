"""The step timer every benchmark shares: steady-state training steps only."""

from __future__ import annotations

import time
from typing import Any

import lightning as L


class StepTimer(L.Callback):
    """Wall time and tokens of the training steps from batch ``warmup`` on.

    The first ``warmup`` batches (allocator warm-up, first-call overheads) are excluded;
    with several ranks a barrier lines them up before the clock starts.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.tokens = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.warmup:
            trainer.strategy.barrier()
            self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if batch_idx >= self.warmup:
            self.end = time.perf_counter()
            self.tokens += batch[0].numel() * trainer.world_size

    @property
    def seconds(self) -> float:
        """Seconds between the start of batch ``warmup`` and the end of the last batch."""
        if self.start is None or self.end is None:
            raise RuntimeError(f"fewer than {self.warmup + 1} training batches ran")
        return self.end - self.start
