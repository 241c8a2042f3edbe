"""Run a function in N CPU processes joined by a gloo group; collect results or tracebacks.

Reusable by every distributed test::

    from _harness import run_distributed

    def _case(rank: int, world_size: int, scale: float) -> float:
        ...  # torch.distributed is initialized (gloo, world group of ``world_size``)

    results = run_distributed(_case, 2, 0.5)  # one result per rank, in rank order

Start-up dominates small tests on two cores: start the processes once per world size and
run several cases inside. The worker environment also carries ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``, so a ``lightning.Trainer`` built inside a worker sees a
torchrun-like launch and joins the existing group instead of starting processes.

Ranks are forked from a fork server (:mod:`multiprocessing`'s ``"forkserver"``), one per
test process, that imported torch, Lightning and plugintrain once: a rank starts in tens of
milliseconds, from a process with no threads of its own. Forking the test process itself
deadlocked once in three ``make test`` runs: a pytest-xdist worker has threads (execnet's),
and a child forked while one of them holds a lock never gets it. Each rank gets the test's
``sys.path`` (so ``fn`` and its module import by name), working directory and
``os.environ`` at the call, not the server's from its start.

No rank outlives the call: a rank that hangs is killed when ``timeout`` runs out, the
others a few seconds after one fails, each with its process group (whatever it started),
and the error names the ranks that gave no result and their exit codes. The rendezvous
store is held by the calling process, on a port the kernel chose for it, so no other
process can take the port between choosing and binding it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
from _processes import adopt, context, stop

_GROUP_TIMEOUT = timedelta(seconds=120)
_GRACE_S = 5.0  # for the peers of a failed rank to report their own errors, and to exit


def _to_bytes(value: Any) -> bytes:
    # Plain bytes through the queue: torch.multiprocessing would pass tensors as shared
    # memory, which keeps the sender alive until the receiver maps them (and can deadlock).
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    fn: Callable,
    payload: bytes,
    results: mp.Queue,
) -> None:
    adopt(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # One intra-op thread per rank: ranks share two cores, oversubscription stalls gloo.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=_GROUP_TIMEOUT)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT
        )
        results.put((rank, True, _to_bytes(fn(rank, world_size, *_from_bytes(payload)))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and return the results.

    ``fn`` must be a module-level function returning what ``torch.save`` can write. If any
    rank raises, the others get a few seconds, then are stopped, and a ``RuntimeError``
    reports every rank's traceback; a rank without a result when ``timeout`` runs out is
    killed and reported the same way.

    Args:
        fn: The per-rank function.
        world_size: Number of processes.
        *args: Extra picklable arguments passed to every rank.
        timeout: Seconds before the whole run is declared hung.
        start_method: ``"forkserver"`` (ranks forked from a single-threaded server that
            has imported torch, Lightning and plugintrain, see the module docstring);
            ``"spawn"`` starts a fresh interpreter per rank (~8 s of imports on two cores
            each); ``"fork"`` forks the calling process, only safe where it has no other
            thread (not under pytest-xdist) and has not touched CUDA.
    """
    ctx = context(start_method)
    # The store lives here, on a port the kernel picked, until every rank has stopped.
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    results = ctx.Queue()
    payload, env = _to_bytes(args), dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, env, fn, payload, results),
            name=f"{fn.__name__}-rank{rank}",
        )
        for rank in range(world_size)
    ]
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        for proc in procs:
            proc.start()
        outcomes = _collect(results, procs, world_size, timeout)
    finally:
        # Ranks that all reported get a few seconds to leave the group and exit; otherwise
        # the failed rank's peers had theirs in _collect, and a hung rank needs none.
        stop(procs, _GRACE_S if len(outcomes) == world_size else 0.0)
        results.close()
        del store
    return _results(fn, world_size, timeout, procs, outcomes)


def _collect(
    results: mp.Queue, procs: list, world_size: int, timeout: float
) -> dict[int, tuple[bool, Any]]:
    """Outcomes until all ranks reported, one failed (plus a grace period) or time ran out."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, out = results.get(timeout=1.0)
        except queue.Empty:
            if len(wait([proc.sentinel for proc in procs], timeout=0)) == len(procs):
                break  # every rank is gone (waited on without reaping it, for stop())
            continue
        outcomes[rank] = (ok, out)
        if not ok:
            # Peers are likely blocked in a collective with the failed rank; let them time out
            # briefly so their own errors show, then stop waiting.
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return outcomes


def _results(
    fn: Callable, world_size: int, timeout: float, procs: list, outcomes: dict
) -> list[Any]:
    failures = {rank: out for rank, (ok, out) in outcomes.items() if not ok}
    missing = sorted(set(range(world_size)) - set(outcomes))
    if failures or missing:
        codes = {rank: procs[rank].exitcode for rank in missing}
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        raise RuntimeError(
            f"{fn.__name__} failed on world size {world_size}; ranks without a result"
            f" within {timeout:.0f} s (hung, then killed, or died), with their exit codes:"
            f" {codes}\n{report}"
        )
    return [_from_bytes(outcomes[rank][1]) for rank in range(world_size)]
