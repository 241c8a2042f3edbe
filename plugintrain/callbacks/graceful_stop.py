"""Every stop is clean: Ctrl-C, SIGTERM, SIGUSR1 (SLURM's warning before a time limit) or
a dead rank end every process of a run within seconds, and a preempted run saves the step
it finished.

Why runs hung before (Lightning 2.6): SIGINT raises ``KeyboardInterrupt`` wherever each
rank happens to be, so the ranks that sit in a collective wait forever for the rank that
left it, and Lightning's interrupt path then runs the strategy's teardown (more
collectives) and ignores every further Ctrl-C; Lightning's SIGTERM handler runs a
``broadcast`` *inside the signal handler*, on whichever ranks received the signal, so the
ranks' collectives no longer pair up; and only rank 0's SIGTERM is ever looked at.

What :class:`GracefulStop` does instead (added to every ``plugintrain fit``):

- Its handlers (SIGINT, SIGTERM, SIGUSR1; Lightning's signal connector is switched off)
  only note the signal: no collective, no I/O beyond one line.
- After every training batch each rank all-reduces (max) the signal it noted, one
  integer, the collective Lightning already runs each batch to broadcast rank 0's SIGTERM
  (and Megatron's ``DistributedSignalHandler`` all-gathers). So a signal to any one rank
  reaches all of them at the same batch; they finish the optimizer step in progress (the
  rest of a gradient accumulation window), then on SIGTERM and SIGUSR1 save the ``last``
  checkpoint through the normal atomic path, under SLURM requeue the job on SIGUSR1, and
  stop together. Each process prints one line and exits with 128 + the signal's number
  (130 SIGINT, 143 SIGTERM, 138 SIGUSR1).
- A second signal exits at once (the same status).
- A watchdog thread on every rank ends the process with one line when the run cannot
  finish the step: another rank aborted (a second signal, an exception: it writes
  ``plugintrain/abort`` into the run's rendezvous store), the store is gone (the process
  that hosted it died), or no step completed within ``grace`` seconds of a signal (a
  rank is gone: its peers wait in a collective that will never complete).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
SAVE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
ABORT_KEY = "plugintrain/abort"


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 128 + its number, as a shell
    reports a process that signal ended."""
    return 128 + int(signum)


class GracefulStop(Callback):
    """Stop every rank together, cleanly, on a signal to any of them (see the module).

    Args:
        grace: Seconds a rank waits, after a signal or after losing the rendezvous store,
            for its step to complete before it exits anyway (a peer is gone).
        save_on_signal: Save the ``last`` checkpoint on SIGTERM and SIGUSR1.
        requeue: Under SLURM (``SLURM_JOB_ID``), requeue the job on SIGUSR1 after saving.
        poll: Seconds between the watchdog's looks at the store.
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
        self.received: int | None = None  # the first signal this process got
        self.agreed: int | None = None  # the signal every rank agreed on
        self.status: int | None = None  # the exit status once stopped by a signal
        self._received_at = 0.0
        self._stepping_done = False  # the stop point was reached: saves may take their time
        self._finished = threading.Event()
        self._progress = time.monotonic()
        self._longest_step = 0.0
        self._step_at_start = 0
        self._previous: dict[int, Any] = {}
        self._trainer: pl.Trainer | None = None
        self._watchdog: threading.Thread | None = None

    # -- setup and teardown ------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._finished.clear()
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:  # its SIGTERM handler runs a collective: never install it
            connector.register_signal_handlers = lambda: None
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="plugintrain-stop-watchdog", daemon=True
            )
            self._watchdog.start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._finished.set()
        self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finished.set()  # a peer that exits first is no failure from here on

    # -- the signal ----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # the second one: at once
            self._say(f"{name} again: stopping now")
            self._abort(f"{name} twice")
            _exit_now(exit_status(signum))
        self.received, self._received_at = signum, time.monotonic()
        saving = " and saving" if self.save_on_signal and signum in SAVE_SIGNALS else ""
        self._say(
            f"{name}: finishing this step{saving}, then stopping ({name} again stops at once)"
        )

    # -- the step ------------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        self._mark_progress()
        agreed = self._agree(trainer)
        if agreed:
            self.agreed = self.agreed or agreed
        if self.agreed is None or trainer.global_step == self._step_at_start:
            return  # mid gradient accumulation: the optimizer step is not done yet
        self._stepping_done = True
        _quiet_launcher_observer()
        saved = self._save(trainer) if self.agreed in SAVE_SIGNALS and self.save_on_signal else None
        requeued = self._requeue(trainer) if self.agreed == signal.SIGUSR1 else False
        trainer.should_stop = True
        # Lightning validates when a run stops early (for early stopping); a preempted run
        # has no time for it.
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_skip_next_val"):
            epoch_loop._skip_next_val = True
        self.status = exit_status(self.agreed)
        name = signal.Signals(self.agreed).name
        where = f"; checkpoint {saved}" if saved else ""
        again = "; SLURM job requeued" if requeued else ""
        self._say(f"stopped by {name} after step {trainer.global_step}{where}{again}")

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._mark_progress()

    def _mark_progress(self) -> None:
        now = time.monotonic()
        self._longest_step = max(self._longest_step, now - self._progress)
        self._progress = now

    @property
    def patience(self) -> float:
        """How long a rank waits for its step after a signal: ``grace``, or twice the
        longest batch seen so far (a large model's step may take longer than ``grace``)."""
        return max(self.grace, 2 * self._longest_step)

    def _agree(self, trainer: pl.Trainer) -> int:
        """The largest signal number any rank received (0: none), one all-reduce."""
        local = int(self.received or 0)
        if not _distributed(trainer):
            return local
        flag = torch.tensor([local], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _save(self, trainer: pl.Trainer) -> str | None:
        """The ``last`` checkpoint of the step just finished, through ModelCheckpoint (every
        rank takes part, as in a periodic save); None without one."""
        callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
        if callback is None or callback.dirpath is None:
            return None
        if callback._last_global_step_saved != trainer.global_step:
            callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
        return callback.last_model_path or None

    def _requeue(self, trainer: pl.Trainer) -> bool:
        """Under SLURM, ``scontrol requeue`` the job (global rank 0), as Lightning's SLURM
        connector does; whether it did."""
        job = os.environ.get("SLURM_JOB_ID")
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        if array is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
            job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if not self.requeue or job is None or not trainer.is_global_zero:
            return False
        try:
            return subprocess.run(["scontrol", "requeue", job], check=False).returncode == 0
        except OSError as error:
            self._say(f"could not requeue SLURM job {job}: {error}")
            return False

    # -- when the step cannot complete ---------------------------------------------------

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._abort(f"{type(exception).__name__}: {str(exception).splitlines()[0][:200]}"
                    if str(exception) else type(exception).__name__)  # fmt: skip

    def _abort(self, reason: str) -> None:
        """Tell every rank's watchdog that this rank is leaving (best effort)."""
        store = _store()
        if store is None:
            return
        with contextlib.suppress(Exception):  # the store may be gone already
            store.set(ABORT_KEY, f"rank {_rank()}: {reason}")

    def _watch(self) -> None:
        store = _store()
        lost_at: float | None = None
        mine = f"rank {_rank()}:"
        while not self._finished.wait(self.poll):
            now = time.monotonic()
            try:
                if store is not None and store.check([ABORT_KEY]):
                    reason = store.get(ABORT_KEY).decode()
                    if not reason.startswith(mine):  # this rank's own exception: Lightning's
                        self._leave(f"the run stopped ({reason})", 1)
                lost_at = None
            except Exception:  # the store's host is gone
                lost_at = lost_at or now
                if now - max(lost_at, self._progress) > self.patience:
                    self._leave("the run's rendezvous store is gone (its host process ended)", 1)
            waited = now - max(self._received_at, self._progress)
            if self.received is not None and not self._stepping_done and waited > self.patience:
                name = signal.Signals(self.received).name
                self._leave(
                    f"{name}: no step completed within {self.patience:.0f} s: a rank is gone",
                    exit_status(self.received),
                )

    def _leave(self, why: str, status: int) -> None:
        if self._finished.is_set():
            return
        self._say(f"{why}; exiting")
        self._abort(why)
        _exit_now(status)

    def _say(self, message: str) -> None:
        print(f"[rank {_rank()}] plugintrain: {message}", file=sys.stderr, flush=True)


def _distributed(trainer: pl.Trainer) -> bool:
    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


def _store() -> Any:
    """The default process group's store (the run's rendezvous store), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _quiet_launcher_observer() -> None:
    """Lightning's launcher watches its child ranks from rank 0 and SIGKILLs every process
    as soon as one exits nonzero: once the run is stopping together, the children's
    128 + signal statuses are expected, and rank 0 must be left to finish."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            thread._run = lambda: True  # type: ignore[attr-defined]


def exit_stopped_process(status: int) -> None:
    """End a process that a signal stopped cleanly: exit handlers run and output flushed,
    then ``os._exit``, skipping the interpreter's finalization (seconds of process-group
    and thread teardown that the stop has no use for)."""
    import atexit

    atexit._run_exitfuncs()
    _exit_now(status)


def _exit_now(status: int) -> None:
    """Leave at once (from a signal handler or the watchdog thread), output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
