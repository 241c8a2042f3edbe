"""Faults to inject into CLI runs in tests (a callback named by class path on the CLI)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback


class KillOnce(Callback):
    """SIGKILL one rank after training step ``step``, in the first attempt of an elastic job.

    Args:
        step: The global step after which the rank dies.
        rank: The global rank that dies.
    """

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, *args) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
