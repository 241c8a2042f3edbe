"""Faults to inject into CLI runs in tests (a callback named by class path on the CLI)."""

from __future__ import annotations

import os
import signal
import signal as signal_module
import time

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


class SignalAt(Callback):
    """Send ``signal`` to this process at the start of micro-batch ``batch`` on global rank
    ``rank`` (in the middle of a gradient accumulation window when ``batch`` is not its
    first), as a scheduler's SIGTERM or SLURM's SIGUSR1 arrives at any moment.

    Args:
        batch: The training batch index (micro-batches count) at whose start it arrives.
        rank: The global rank that receives it.
        signal: Its name (``SIGTERM``, ``SIGUSR1``, ``SIGINT``).
    """

    def __init__(self, batch: int, rank: int = 1, signal: str = "SIGTERM") -> None:
        self.batch, self.rank, self.signum = batch, rank, getattr(signal_module, signal)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


class SlowSteps(Callback):
    """Sleep ``seconds`` after every training batch once the file ``after`` exists (a stop
    then takes at least as long).

    Args:
        seconds: The sleep.
        after: The path of the file that starts it.
    """

    def __init__(self, seconds: float, after: str) -> None:
        self.seconds, self.after = seconds, after

    def on_train_batch_end(self, *args) -> None:
        if os.path.exists(self.after):
            time.sleep(self.seconds)


class TouchAt(Callback):
    """Create the file ``path`` after training step ``step`` on global rank 0 (a test's
    sign that the run is training, without checkpoints)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            open(self.path, "a").close()
