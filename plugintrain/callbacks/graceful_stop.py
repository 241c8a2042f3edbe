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

- Python handlers for SIGINT, SIGTERM, SIGUSR1 (and the SLURM environment's requeue
  signal) that do nothing; Lightning's signal connector is switched off. Python runs a
  handler only when the main thread is back in Python code, which a rank blocked in a
  collective never is: so the signals are read instead by a watchdog thread from
  ``signal.set_wakeup_fd``'s pipe, into which the interpreter's C-level handler writes
  each signal's number the moment it arrives.
- After every training batch each rank all-reduces (max) the signal it noted: one integer,
  in place of the broadcast Lightning runs each batch for rank 0's SIGTERM (switched off).
  So a signal to any one rank reaches all of them at the same batch. SIGINT stops there;
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
  into the run's rendezvous store), the store is gone for ``grace`` seconds (the process
  that hosted it died), or, once a signal arrived, the run made no progress for
  ``max(grace, 2 x the longest training batch so far)`` (a rank is gone: its peers wait in
  a collective that will never complete). Checkpoint saves and validation are not timed: a
  signal during them takes effect when they end (a save in progress completes). A rank
  that dies outright is the launcher's to clean up: torchrun's agent and ``srun
  --kill-on-bad-exit=1`` end the other workers, and under Lightning's own launcher rank 0
  does (or, if rank 0 died, the others find its store gone).
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
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # the pipe signal numbers arrive on
        self._previous_wakeup = -1
        self._watchdog: threading.Thread | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> GracefulStop:
        """A fresh callback with the same options (its threads, pipe and event are this
        run's own): what a copy of a trainer's module graph gets (the LoRA callback's
        meta-device probe copies the module, which may reach the trainer)."""
        return GracefulStop(self.grace, self.save_on_signal, self.requeue, self.poll)

    def _reset(self) -> None:
        self.received: int | None = None  # the first signal this process got
        self.agreed: int | None = None  # the signal every rank agreed on
        self.status: int | None = None  # the exit status once stopped by a signal
        self._received_at = 0.0
        self._stepping_done = False  # the stop point was reached: saves may take their time
        self._finished = threading.Event()
        self._batch_started_at: float | None = None  # inside a training batch since then
        self._timed_since: float | None = None  # the deadline's clock: this phase began then
        self._paused = 0  # saving or validating: no deadline
        self._longest_batch = 0.0
        self._batches = 0
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
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:  # its SIGTERM handler runs a collective: never install it
            connector.register_signal_handlers = lambda: None
        # Lightning broadcasts rank 0's SIGTERM flag before every batch: the all-reduce
        # after each batch (`_agree`) replaces it, one collective per batch.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        if not hasattr(trainer.save_checkpoint, "plugintrain_paused"):
            trainer.save_checkpoint = self._paused_while(trainer.save_checkpoint)
        if threading.current_thread() is threading.main_thread():
            for signum in {*STOP_SIGNALS, self._requeue_signal}:
                self._previous[signum] = signal.signal(signum, _note_in_watchdog)
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = (read, write)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._watchdog = threading.Thread(
            target=_watch, args=(self,), name="plugintrain-stop-watchdog", daemon=True
        )
        self._watchdog.start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finished.set()  # a peer that exits first is no failure from here on

    def _release(self) -> None:
        """Stop the watchdog, put the previous handlers and wakeup fd back."""
        self._finished.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=self.poll + 1)
        self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            if self._wakeup is not None:
                signal.set_wakeup_fd(self._previous_wakeup)
        self._previous = {}
        if self._wakeup is not None:
            for fd in self._wakeup:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wakeup = None

    # -- the signal (in the watchdog thread) ---------------------------------------------

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if self.received == self._requeue_signal and signum == signal.SIGTERM:
                return  # SLURM ending the job it requeued: the stop is under way
            if signum == self.received or signum == signal.SIGINT:  # the second one: at once
                _say(f"{name} again: stopping now")
                _abort(f"{name} twice")
                _exit_now(exit_status(signum))
            return
        self._received_at = time.monotonic()
        self.received = signum
        saves = self.save_on_signal and signum in (*SAVE_SIGNALS, self._requeue_signal)
        what = "finishing this step and saving" if saves else "stopping after this batch"
        _say(f"{name}: {what}, then stopping ({name} again stops at once)")

    # -- the step ------------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step
        self._batch_started_at = self._timed_since = time.monotonic()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if self.status is not None:  # stopping already (Lightning runs on to min_steps)
            return
        agreed = _agree(trainer, self.received)  # timed as part of the batch: a peer may be gone
        if agreed:
            self.agreed = self.agreed or agreed
        self._end_batch()
        saves = self.agreed in (*SAVE_SIGNALS, self._requeue_signal)
        if self.agreed is None or (saves and trainer.global_step == self._step_at_start):
            return  # no signal, or mid gradient accumulation: the optimizer step is not done
        self._stepping_done = True
        _quiet_launcher_observer()
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
        _say(f"stopped by {name} after step {trainer.global_step}{where}{again}")

    def _end_batch(self) -> None:
        now = time.monotonic()
        if self._batch_started_at is not None:
            self._longest_batch = max(self._longest_batch, now - self._batch_started_at)
            self._batches += 1
        self._batch_started_at = None
        self._timed_since = now  # between batches: timed too (saves and validation are not)

    def _paused_while(self, save: Any) -> Any:
        """``trainer.save_checkpoint``, with the deadline paused while it runs: a save in
        progress completes."""

        def paused_save(*args: Any, **kwargs: Any) -> Any:
            self._paused += 1
            try:
                return save(*args, **kwargs)
            finally:
                self._paused -= 1
                self._timed_since = time.monotonic()

        paused_save.plugintrain_paused = True  # type: ignore[attr-defined]
        return paused_save

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._paused += 1

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._paused = max(0, self._paused - 1)
        self._timed_since = time.monotonic()

    @property
    def patience(self) -> float:
        """How long the run may make no progress after a signal: ``grace``, or twice the
        longest training batch so far (a large model's step may take longer than
        ``grace``)."""
        return max(self.grace, 2 * self._longest_batch)

    # -- when the step cannot complete ---------------------------------------------------

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        text = str(exception).splitlines()[0][:200] if str(exception) else ""
        _abort(f"{type(exception).__name__}: {text}" if text else type(exception).__name__)
        self._release()  # Lightning skips `teardown` hooks after an exception

    def _check_deadline(self, now: float) -> None:
        """After a signal, leave if the run makes no progress for :attr:`patience`: timed
        once a first batch completed (which sets the pace), in training batches and
        between them, not while a checkpoint is saved or validation runs."""
        received, since = self.received, self._timed_since
        if received is None or self._stepping_done or since is None or not self._batches:
            return
        if self._paused:
            return
        waited = now - max(self._received_at, since)
        if waited > self.patience:
            name = signal.Signals(received).name
            self._leave(
                f"{name}: the run did not complete within {self.patience:.0f} s: a rank is gone",
                exit_status(received),
            )

    def _leave(self, why: str, status: int) -> None:
        if self._finished.is_set():
            return
        _say(f"{why}; exiting")
        _abort(why)
        _exit_now(status)


def _watch(stop: GracefulStop) -> None:
    """The watchdog thread of ``stop`` (see the module)."""
    import select

    store = _store()
    lost_at: float | None = None
    mine = f"rank {_rank()}:"
    wakeup = stop._wakeup[0] if stop._wakeup is not None else None
    while not stop._finished.is_set():
        if wakeup is None:
            stop._finished.wait(stop.poll)
        else:
            with contextlib.suppress(OSError, ValueError):
                if select.select([wakeup], [], [], stop.poll)[0]:
                    for signum in os.read(wakeup, 64):
                        stop._on_signal(signum)
        if stop._finished.is_set():
            return
        now = time.monotonic()
        try:
            if store is not None and store.check([ABORT_KEY]):
                reason = store.get(ABORT_KEY).decode()
                if not reason.startswith(mine):  # this rank's own exception: Lightning's
                    stop._leave(f"the run stopped ({reason})", 1)
            lost_at = None
        except Exception:  # the store's host is gone
            lost_at = lost_at or now
            if now - lost_at > stop.grace:
                stop._leave("the run's rendezvous store is gone (its host process ended)", 1)
        stop._check_deadline(now)


def _stop(trainer: pl.Trainer) -> None:
    """Leave the fit loop after this batch, without the validation Lightning runs when
    a run stops early, and whatever ``min_steps`` / ``min_epochs`` say."""
    trainer.should_stop = True
    fit_loop = trainer.fit_loop
    fit_loop.min_epochs = 0
    fit_loop.epoch_loop.min_steps = 0
    if hasattr(fit_loop.epoch_loop, "_skip_next_val"):
        fit_loop.epoch_loop._skip_next_val = True


def _agree(trainer: pl.Trainer, received: int | None) -> int:
    """The largest signal number any rank received (0: none), one all-reduce."""
    local = int(received or 0)
    if not _distributed(trainer):
        return local
    flag = torch.tensor([local], dtype=torch.int32, device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _save(trainer: pl.Trainer) -> str | None:
    """The checkpoint of the step just finished, through ModelCheckpoint's atomic path
    (every rank takes part, as in a periodic save): ``last`` as ModelCheckpoint names
    it, written even where ``save_last`` is off or a link; None without a checkpoint
    directory."""
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if callback is None or callback.dirpath is None:
        return None
    candidates = callback._monitor_candidates(trainer)
    if callback.save_last is True:
        saved = callback._last_global_step_saved == trainer.global_step
        if not (saved and callback.last_model_path):
            callback._save_last_checkpoint(trainer, candidates)
        return callback.last_model_path or None
    path = callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
    callback._save_checkpoint(trainer, path)
    callback.last_model_path = path
    return path


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
        _say(f"could not requeue SLURM job {job}: {error}")
        return False
    if not done:
        _say(f"`scontrol requeue {job}` failed; resume with --ckpt_path last")
    return done


def _abort(reason: str) -> None:
    """Tell every rank's watchdog that this rank is leaving (best effort)."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # the store may be gone already
        store.set(ABORT_KEY, f"rank {_rank()}: {reason}")


def _say(message: str) -> None:
    """One line on stderr, written directly (safe from a signal or another thread)."""
    with contextlib.suppress(OSError):
        os.write(2, f"[rank {_rank()}] plugintrain: {message}\n".encode())


def _note_in_watchdog(_signum: int, _frame: Any) -> None:
    """The Python-level handler: nothing to do. Installing it keeps the default action
    (exit, or ``KeyboardInterrupt``) away; the interpreter's C handler writes the
    signal's number to the wakeup pipe, where the watchdog thread reads it at once."""


def _slurm_requeue(trainer: pl.Trainer, wanted: bool) -> tuple[int, bool]:
    """Lightning's rules: under ``SLURMEnvironment``, its ``requeue_signal`` (SIGUSR1 by
    default), and whether to requeue on it (``auto_requeue``); elsewhere SIGUSR1, never."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    connector = getattr(trainer, "_accelerator_connector", None)
    environment = getattr(connector, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment):
        requeue_signal = environment.requeue_signal or signal.SIGUSR1
        return int(requeue_signal), wanted and environment.auto_requeue
    return int(signal.SIGUSR1), False


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
    """Leave at once. From the watchdog thread (the main thread may hold the streams'
    locks): no flush, the status only."""
    if threading.current_thread() is threading.main_thread():
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
