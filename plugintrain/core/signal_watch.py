"""Signals seen the moment they arrive, and a watchdog that can end a process whose main
thread is stuck (no Lightning here; ``plugintrain/callbacks/graceful_stop.py`` builds the
stop of a training run on it, docs/guides/multi-node.md tells why).

Python runs a signal handler only when the main thread is back in Python code, which a
rank blocked in a collective never is. So :class:`SignalWatch` installs handlers that do
nothing and reads the signals from ``signal.set_wakeup_fd``'s pipe, into which the
interpreter's C-level handler writes each signal's number at once, in a thread of its
own. :class:`PeerWatch` reads the run's rendezvous store for another rank's abort, and
notices the store is gone; :class:`ProgressClock` says when a run has made no progress
for too long; :func:`agree_max` is the one all-reduce by which the ranks agree on a signal.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from plugintrain.core.lightning_seam import default_store

ABORT_KEY = "plugintrain/abort"
"""The store key a rank that leaves writes its reason under."""


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 128 + its number, as a shell
    reports a process that signal ended."""
    return 128 + int(signum)


def process_rank() -> int:
    """This process's global rank (0 outside a process group). Imports nothing: a
    process without ``torch.distributed`` loaded has no process group."""
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    return dist.get_rank() if initialized else 0


def say(message: str) -> None:
    """One line on stderr, written directly (safe from a signal or another thread)."""
    with contextlib.suppress(OSError):
        os.write(2, f"[rank {process_rank()}] plugintrain: {message}\n".encode())


def exit_now(status: int) -> None:
    """Leave at once. From another thread (the main thread may hold the streams' locks):
    no flush, the status only."""
    if threading.current_thread() is threading.main_thread():
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def announce_abort(reason: str) -> None:
    """Tell every rank's watchdog that this rank is leaving (best effort)."""
    store = default_store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # the store may be gone already
        store.set(ABORT_KEY, f"rank {process_rank()}: {reason}")


def agree_max(value: int, device: Any) -> int:
    """The largest ``value`` any rank holds: one all-reduce (max) of one integer over the
    default process group on ``device``; ``value`` itself without one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _do_nothing(_signum: int, _frame: Any) -> None:
    """The Python-level handler: installing it keeps the default action (exit, or
    ``KeyboardInterrupt``) away; the signal's number reaches the wakeup pipe."""


class SignalWatch:
    """A thread that calls ``on_signal(signum)`` for each watched signal the moment it
    arrives (read from the wakeup pipe), and ``on_tick(now)`` at least every ``poll``
    seconds, until :meth:`finish`.

    Signals are watched only when started from the main thread (where Python allows
    handlers); elsewhere the thread only ticks.

    Args:
        on_signal: Called in the watch thread with each signal's number.
        on_tick: Called in the watch thread with ``time.monotonic()``.
        poll: The longest time between ticks, in seconds.
    """

    def __init__(
        self, on_signal: Callable[[int], None], on_tick: Callable[[float], None], poll: float
    ) -> None:
        self.on_signal, self.on_tick, self.poll = on_signal, on_tick, poll
        self.finished = threading.Event()
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None  # the pipe signal numbers arrive on
        self._previous_wakeup = -1
        self._thread: threading.Thread | None = None

    def start(self, signals: Iterable[int]) -> None:
        """Take over ``signals`` (from the main thread) and start the watch thread."""
        if threading.current_thread() is threading.main_thread():
            for signum in set(signals):
                self._previous[signum] = signal.signal(signum, _do_nothing)
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._pipe = (read, write)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(
            target=self._watch, name="plugintrain-stop-watchdog", daemon=True
        )
        self._thread.start()

    def finish(self) -> None:
        """Stop calling back: the thread ends now (woken by a 0 on the pipe, which is no
        signal's number), not at the end of its ``poll``."""
        self.finished.set()
        if self._pipe is not None:
            with contextlib.suppress(OSError):  # full (it is awake then) or closed
                os.write(self._pipe[1], b"\0")

    def close(self) -> None:
        """Finish, wait for the thread, put the previous handlers and wakeup fd back."""
        self.finish()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 1)
        self._thread = None
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            if self._pipe is not None:
                signal.set_wakeup_fd(self._previous_wakeup)
        self._previous = {}
        if self._pipe is not None:
            for fd in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    def _watch(self) -> None:
        wakeup = self._pipe[0] if self._pipe is not None else None
        while not self.finished.is_set():
            if wakeup is None:
                self.finished.wait(self.poll)
            else:
                with contextlib.suppress(OSError, ValueError):
                    if select.select([wakeup], [], [], self.poll)[0]:
                        for signum in os.read(wakeup, 64):
                            if signum:
                                self.on_signal(signum)
            if self.finished.is_set():
                return
            self.on_tick(time.monotonic())


class PeerWatch:
    """The run's rendezvous store, read for a reason to leave: another rank's abort (not
    this rank's own), or the store gone for ``grace`` seconds (its host process ended).

    Args:
        store: The store (None: nothing to watch).
        rank: This process's global rank.
        grace: Seconds the store may be unreachable.
    """

    def __init__(self, store: Any, rank: int, grace: float) -> None:
        self.store, self.grace = store, grace
        self._mine = f"rank {rank}:"
        self._lost_at: float | None = None

    def why_leave(self, now: float) -> str | None:
        """The reason to leave now, if there is one."""
        if self.store is None:
            return None
        try:
            if self.store.check([ABORT_KEY]):
                reason = self.store.get(ABORT_KEY).decode()
                if not reason.startswith(self._mine):  # this rank's own exception: Lightning's
                    return f"the run stopped ({reason})"
            self._lost_at = None
        except Exception:  # the store's host is gone
            self._lost_at = self._lost_at or now
            if now - self._lost_at > self.grace:
                return "the run's rendezvous store is gone (its host process ended)"
        return None


class ProgressClock:
    """How long a run has made no progress: timed in steps and between them, paused
    while a checkpoint is saved or validation runs (those are never cut short).

    Args:
        grace: The least patience, in seconds.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.batches = 0  # training batches completed
        self._longest = 0.0
        self._batch_started_at: float | None = None  # inside a training batch since then
        self._since: float | None = None  # the clock: this timed phase began then
        self._paused = 0

    @property
    def patience(self) -> float:
        """How long the run may make no progress: ``grace``, or twice the longest training
        batch so far (a large model's step may take longer than ``grace``)."""
        return max(self.grace, 2 * self._longest)

    def batch_started(self, now: float) -> None:
        self._batch_started_at = self._since = now

    def batch_ended(self, now: float) -> None:
        if self._batch_started_at is not None:
            self._longest = max(self._longest, now - self._batch_started_at)
            self.batches += 1
        self._batch_started_at = None
        self._since = now  # between batches: timed too

    def pause(self) -> None:
        self._paused += 1

    def resume(self, now: float) -> None:
        self._paused = max(0, self._paused - 1)
        self._since = now

    def stalled(self, now: float, since: float) -> bool:
        """Whether the run made no progress for :attr:`patience` after ``since`` (when a
        signal arrived): timed once a first batch completed (which sets the pace), never
        while paused."""
        if self._since is None or not self.batches or self._paused:
            return False
        return now - max(since, self._since) > self.patience
