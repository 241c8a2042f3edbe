"""The signal pipe and the watchdog, without Lightning (``plugintrain/core/signal_watch.py``):
a real signal reaches ``on_signal`` in the watch thread while the main thread is blocked,
also in a child process that it then ends with 128 + the signal's number; the watchdog
ticks; the previous handlers come back; a peer's abort and a lost store are seen; the
progress clock's patience and pauses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import HashStore

from plugintrain.core.signal_watch import (
    ABORT_KEY,
    PeerWatch,
    ProgressClock,
    SignalWatch,
    agree_max,
    exit_status,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_signal_reaches_the_watch_thread_while_the_main_thread_waits() -> None:
    seen: list[tuple[int, str]] = []
    arrived = threading.Event()

    def on_signal(signum: int) -> None:
        seen.append((signum, threading.current_thread().name))
        arrived.set()

    before = signal.getsignal(signal.SIGUSR1)
    watch = SignalWatch(on_signal, lambda now: None, poll=0.05)
    watch.start([signal.SIGUSR1])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # its default action would end this process
        assert arrived.wait(5.0)
    finally:
        watch.close()
    assert seen == [(signal.SIGUSR1, "plugintrain-stop-watchdog")]
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.set_wakeup_fd(-1) == -1  # the previous wakeup fd (none) is back


CHILD = """
import sys, time
from plugintrain.core.signal_watch import SignalWatch, exit_now, exit_status, say
def on_signal(signum):
    say(f"got {signum}")
    exit_now(exit_status(signum))
SignalWatch(on_signal, lambda now: None, poll=1.0).start([15, 2])
print("ready", flush=True)
time.sleep(60)  # the main thread never gets back to Python code before the signal
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_a_child_process_ends_it_through_the_pipe(signum: int) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        child.send_signal(signum)
        status = child.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        child.kill()
        child.wait()
    assert child.stderr is not None
    err = child.stderr.read()
    assert status == exit_status(signum) == 128 + signum, err
    assert f"[rank 0] plugintrain: got {signum}" in err and "Traceback" not in err, err
    assert took < 2.0, took


def test_the_watchdog_ticks_and_finishes_off_the_main_thread() -> None:
    ticks: list[float] = []
    watch = SignalWatch(lambda signum: None, ticks.append, poll=0.02)
    started = threading.Thread(target=watch.start, args=([signal.SIGUSR1],))
    started.start()  # off the main thread: no handlers, ticks only
    started.join()
    time.sleep(0.3)
    watch.finish()
    time.sleep(0.1)
    count = len(ticks)
    time.sleep(0.1)
    watch.close()
    assert count >= 5 and len(ticks) == count  # ticked, then stopped
    assert ticks == sorted(ticks)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_peer_abort_is_seen_but_not_this_ranks_own() -> None:
    store = HashStore()
    mine, peer = PeerWatch(store, 1, grace=5.0), PeerWatch(store, 0, grace=5.0)
    assert mine.why_leave(0.0) is None
    store.set(ABORT_KEY, "rank 1: RuntimeError: boom")
    assert mine.why_leave(1.0) is None
    assert peer.why_leave(1.0) == "the run stopped (rank 1: RuntimeError: boom)"
    assert PeerWatch(None, 0, grace=5.0).why_leave(1.0) is None


def test_a_store_gone_for_longer_than_grace_is_a_reason_to_leave() -> None:
    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("connection reset")

    watch = PeerWatch(Gone(), 0, grace=5.0)
    assert watch.why_leave(10.0) is None
    assert watch.why_leave(15.0) is None
    assert watch.why_leave(15.5) == "the run's rendezvous store is gone (its host process ended)"


def test_the_clock_times_batches_and_pauses_for_saves() -> None:
    clock = ProgressClock(grace=5.0)
    assert not clock.stalled(100.0, 0.0)  # no batch completed yet: no pace
    clock.batch_started(0.0)
    clock.batch_ended(4.0)
    assert clock.patience == 8.0 and clock.batches == 1  # twice the longest batch
    clock.batch_started(4.0)
    assert not clock.stalled(11.0, since=5.0)
    assert clock.stalled(13.5, since=5.0)  # 8.5 s since the signal, in one batch
    clock.pause()  # a checkpoint save: never cut short
    assert not clock.stalled(100.0, since=5.0)
    clock.resume(100.0)
    assert not clock.stalled(107.0, since=5.0) and clock.stalled(108.5, since=5.0)
    assert ProgressClock(grace=5.0).patience == 5.0


def test_agree_max_without_a_process_group_is_the_value_itself() -> None:
    assert agree_max(15, "cpu") == 15 and agree_max(0, "cpu") == 0


def test_closing_wakes_the_watch_thread_at_once() -> None:
    """A stopped run does not wait out the watchdog's ``poll`` on its way out."""
    watch = SignalWatch(lambda signum: None, lambda now: None, poll=30.0)
    watch.start([signal.SIGUSR1])
    time.sleep(0.1)  # the thread is in its 30 s wait
    started = time.monotonic()
    watch.close()
    assert time.monotonic() - started < 1.0
