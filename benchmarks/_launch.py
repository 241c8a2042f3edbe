"""Start every rank of a benchmark as its own process and check how each one exits.

``run_ranks`` runs a Lightning script once per rank. Lightning's own launcher reruns the
script for ranks > 0 and never waits for them: a rank that aborts at exit goes unseen,
or takes rank 0 down with it only when Lightning's observer thread happens to look. Here
every rank is started the way ``torchrun`` starts them (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_PORT`` set, so Lightning joins instead of launching).

``gather`` collects the results of forked rank processes and fails as soon as one of
them dies, instead of waiting out the timeout for a result that cannot come.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended."""

    rank: int
    returncode: int
    output: str
    """Its stdout and stderr, interleaved."""


def free_port() -> int:
    """A TCP port that was free a moment ago, for the rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    args: list[str], world: int, cwd: str | Path | None = None, timeout: float = 900
) -> list[RankExit]:
    """Run ``python ARGS`` once per rank of a ``world``-process group; wait for all of them.

    Each rank writes to its own file, not a pipe: a rank blocked on a full pipe would stall
    the collective its peers wait in.
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(WORLD_SIZE=str(world), NODE_RANK="0", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"rank{rank}.log" for rank in range(world)]
        procs = []
        for rank, path in enumerate(paths):
            with path.open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *args],
                        cwd=cwd,
                        env={**env, "LOCAL_RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = [_wait(proc, timeout) for proc in procs]
        return [
            RankExit(rank, code, path.read_text())
            for rank, (code, path) in enumerate(zip(codes, paths, strict=True))
        ]


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def gather(results: mp.Queue, procs: list[mp.Process], timeout: float) -> dict[int, Any]:
    """The ``(rank, value)`` every process in ``procs`` puts on ``results``; raises once a
    rank exits without one, or exits non-zero after it, or at ``timeout`` (stopping all)."""
    by_rank: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(by_rank) < len(procs):
        try:
            rank, value = results.get(timeout=1)
            by_rank[rank] = value
        except queue.Empty:
            # A rank that died cannot report; one still alive past the deadline hangs.
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead or time.monotonic() > deadline:
                _stop(procs)
                raise RuntimeError(f"no result from every rank; exit codes: {dead}") from None
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 1.0))
    codes = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if codes:
        _stop(procs)
        raise RuntimeError(f"ranks reported, then did not exit with 0: {codes}")
    return by_rank


def _stop(procs: list[mp.Process]) -> None:
    for proc in procs:
        proc.kill()
        proc.join()
