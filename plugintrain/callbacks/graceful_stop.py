"""Every stop is clean: Ctrl-C, SIGTERM, SIGUSR1 (SLURM's warning before a time limit) or
a dead rank end every process of a run within seconds, and a preempted run saves the step
it finished. Why runs hung before, and the measured stop times: docs/guides/multi-node.md.

What :class:`GracefulStop` does (added to every ``plugintrain fit``):

- Lightning's signal connector and its per-batch SIGTERM broadcast are switched off
  (``plugintrain/core/lightning_seam.py``); SIGINT, SIGTERM, SIGUSR1 (and the SLURM
  environment's requeue signal) are read by a watchdog thread the moment they arrive
  (:class:`~plugintrain.core.signal_watch.SignalWatch`), also on a rank blocked in a
  collective.
- After every training batch each rank all-reduces (max) the signal it noted: one integer,
  so a signal to any one rank reaches all of them at the same batch. SIGINT stops there;
  SIGTERM and SIGUSR1 finish the optimizer step in progress (the rest of a gradient
  accumulation window), save the ``last`` checkpoint through the normal atomic path, and
  under SLURM with Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default) rank
  0 requeues the job on the requeue signal (``scontrol requeue``, as Lightning's SLURM
  connector does) while the others wait for it. Each process prints one line and exits
  with 128 + the signal's number (130 SIGINT, 143 SIGTERM, 138 SIGUSR1).
- A second SIGINT, or the same signal again, exits at once (the same status). SIGTERM
  after the requeue signal is SLURM ending the requeued job, and is ignored.
- The watchdog ends the process with one line when the run cannot finish its step:
  another rank aborted (a second signal, an exception: it writes ``plugintrain/abort``
  into the run's rendezvous store), the store is gone for ``grace`` seconds, or, once a
  signal arrived, the run made no progress for ``max(grace, 2 x the longest training batch
  so far)`` (a rank is gone). Checkpoint saves and validation are not timed: a signal
  during them takes effect when they end (a save in progress completes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from plugintrain.core import lightning_seam
from plugintrain.core.signal_watch import (
    PeerWatch,
    ProgressClock,
    SignalWatch,
    agree_max,
    announce_abort,
    exit_now,
    exit_status,
    process_rank,
    say,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
SAVE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class GracefulStop(Callback):
    """Stop every rank together, cleanly, on a signal to any of them (see the module).

    Args:
        grace: Seconds a rank waits, after a signal, for a training batch to complete
            before it exits anyway (at least twice the longest batch so far), and for the
            rendezvous store to come back once it is gone.
        save_on_signal: Save the ``last`` checkpoint on SIGTERM and SIGUSR1.
        requeue: Under SLURM (Lightning's ``SLURMEnvironment`` with ``auto_requeue``),
            requeue the job on its requeue signal (SIGUSR1) after saving.
        poll: Seconds between the watchdog's looks at the store and the clock.
    """

    def __init__(
        self,
        grace: float = 5.0,
        save_on_signal: bool = True,
        requeue: bool = True,
        poll: float = 1.0,
    ) -> None:
        self.grace, self.save_on_signal, self.requeue, self.poll = (
            grace,
            save_on_signal,
            requeue,
            poll,
        )
        self._reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> GracefulStop:
        """A fresh callback with the same options (its thread, pipe and clock are this
        run's own): what a copy of a trainer's module graph gets (the LoRA callback's
        meta-device probe copies the module, which may reach the trainer)."""
        return GracefulStop(self.grace, self.save_on_signal, self.requeue, self.poll)

    def _reset(self) -> None:
        self.received: int | None = None  # the first signal this process got
        self.agreed: int | None = None  # the signal every rank agreed on
        self.status: int | None = None  # the exit status once stopped by a signal
        self._received_at = 0.0
        self._stepping_done = False  # the stop point was reached: saves may take their time
        self._clock = ProgressClock(self.grace)
        self._peers = PeerWatch(None, 0, self.grace)
        self._watch = SignalWatch(self._on_signal, self._on_tick, self.poll)
        self._step_at_start = 0
        self._requeue_signal = signal.SIGUSR1
        self._requeues = False

    # -- setup and teardown ------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()  # a second fit in the same process starts clean
        self._requeue_signal, self._requeues = _slurm_requeue(trainer, self.requeue)
        lightning_seam.switch_off_signal_handlers(trainer)
        lightning_seam.switch_off_sigterm_broadcast(trainer)  # `_agree` replaces it
        lightning_seam.wrap_save_checkpoint(trainer, self._paused_while)
        self._peers = PeerWatch(lightning_seam.default_store(), process_rank(), self.grace)
        self._watch.start({*STOP_SIGNALS, self._requeue_signal})

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._watch.close()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch.finish()  # a peer that exits first is no failure from here on

    # -- the watchdog thread -------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if self.received == self._requeue_signal and signum == signal.SIGTERM:
                return  # SLURM ending the job it requeued: the stop is under way
            if signum == self.received or signum == signal.SIGINT:  # the second one: at once
                say(f"{name} again: stopping now")
                announce_abort(f"{name} twice")
                exit_now(exit_status(signum))
            return
        self._received_at = time.monotonic()
        self.received = signum
        saves = self.save_on_signal and signum in (*SAVE_SIGNALS, self._requeue_signal)
        what = "finishing this step and saving" if saves else "stopping after this batch"
        say(f"{name}: {what}, then stopping ({name} again stops at once)")

    def _on_tick(self, now: float) -> None:
        why = self._peers.why_leave(now)
        if why is not None:
            self._leave(why, 1)
        received = self.received
        if received is None or self._stepping_done:
            return
        if self._clock.stalled(now, self._received_at):
            name = signal.Signals(received).name
            self._leave(
                f"{name}: the run did not complete within {self.patience:.0f} s: a rank is gone",
                exit_status(received),
            )

    def _leave(self, why: str, status: int) -> None:
        if self._watch.finished.is_set():
            return
        say(f"{why}; exiting")
        announce_abort(why)
        exit_now(status)

    @property
    def patience(self) -> float:
        """How long the run may make no progress after a signal (see ``ProgressClock``)."""
        return self._clock.patience

    # -- the step ------------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step
        self._clock.batch_started(time.monotonic())

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.status is not None:  # stopping already (Lightning runs on to min_steps)
            return
        agreed = _agree(trainer, self.received)  # timed as part of the batch: a peer may be gone
        if agreed:
            self.agreed = self.agreed or agreed
        self._clock.batch_ended(time.monotonic())
        saves = self.agreed in (*SAVE_SIGNALS, self._requeue_signal)
        if self.agreed is None or (saves and trainer.global_step == self._step_at_start):
            return  # no signal, or mid gradient accumulation: the optimizer step is not done
        self._stepping_done = True
        lightning_seam.silence_launcher_observer()
        saved = _save(trainer) if saves and self.save_on_signal else None
        requeued = False
        if self.agreed == self._requeue_signal and self._requeues:
            requeued = _requeue(trainer)
            if _distributed(trainer):
                trainer.strategy.barrier("plugintrain-requeue")  # rank 0 has requeued
        _stop(trainer)
        self.status = exit_status(self.agreed)
        name = signal.Signals(self.agreed).name
        where = f"; checkpoint {saved}" if saved else ""
        again = "; SLURM job requeued" if requeued else ""
        say(f"stopped by {name} after step {trainer.global_step}{where}{again}")

    def _paused_while(self, save: Callable[..., Any]) -> Callable[..., Any]:
        """``trainer.save_checkpoint``, with the deadline paused while it runs: a save in
        progress completes."""

        def paused_save(*args: Any, **kwargs: Any) -> Any:
            self._clock.pause()
            try:
                return save(*args, **kwargs)
            finally:
                self._clock.resume(time.monotonic())

        return paused_save

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.resume(time.monotonic())

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        text = str(exception).splitlines()[0][:200] if str(exception) else ""
        announce_abort(f"{type(exception).__name__}: {text}" if text else type(exception).__name__)
        self._watch.close()  # Lightning skips `teardown` hooks after an exception


def _stop(trainer: pl.Trainer) -> None:
    """Leave the fit loop after this batch, without the validation Lightning runs when
    a run stops early, and whatever ``min_steps`` / ``min_epochs`` say."""
    trainer.should_stop = True
    trainer.fit_loop.min_epochs = 0
    trainer.fit_loop.epoch_loop.min_steps = 0
    lightning_seam.skip_validation_on_stop(trainer)


def _agree(trainer: pl.Trainer, received: int | None) -> int:
    """The largest signal number any rank received (0: none), one all-reduce."""
    local = int(received or 0)
    return agree_max(local, trainer.strategy.root_device) if _distributed(trainer) else local


def _save(trainer: pl.Trainer) -> str | None:
    """The checkpoint of the step just finished, ``last`` as ModelCheckpoint names it
    (see ``lightning_seam.save_last_checkpoint``); None without a checkpoint directory."""
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if callback is None or callback.dirpath is None:
        return None
    return lightning_seam.save_last_checkpoint(callback, trainer) or None


def _requeue(trainer: pl.Trainer) -> bool:
    """On global rank 0, ``scontrol requeue`` the job, as Lightning's SLURM connector
    does; whether it did."""
    job = os.environ.get("SLURM_JOB_ID")
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
        job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if job is None or not trainer.is_global_zero:
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job], check=False).returncode == 0
    except OSError as error:
        say(f"could not requeue SLURM job {job}: {error}")
        return False
    if not done:
        say(f"`scontrol requeue {job}` failed; resume with --ckpt_path last")
    return done


def _slurm_requeue(trainer: pl.Trainer, wanted: bool) -> tuple[int, bool]:
    """Lightning's rules: under ``SLURMEnvironment``, its ``requeue_signal`` (SIGUSR1 by
    default), and whether to requeue on it (``auto_requeue``); elsewhere SIGUSR1, never."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = lightning_seam.cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment):
        requeue_signal = environment.requeue_signal or signal.SIGUSR1
        return int(requeue_signal), wanted and environment.auto_requeue
    return int(signal.SIGUSR1), False


def _distributed(trainer: pl.Trainer) -> bool:
    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


def exit_stopped_process(status: int) -> None:
    """End a process that a signal stopped cleanly: exit handlers run and output flushed,
    then ``os._exit``, skipping the interpreter's finalization (seconds of process-group
    and thread teardown that the stop has no use for)."""
    lightning_seam.run_exit_handlers()
    exit_now(status)
