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
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port that was free a moment ago, for the rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # Plain bytes through the queue: torch.multiprocessing would pass tensors as shared
    # memory, which keeps the sender alive until the receiver maps them (and can deadlock).
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, payload: bytes, results: mp.Queue
) -> None:
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
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        args = torch.load(io.BytesIO(payload), weights_only=False)
        results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
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
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and return the results.

    ``fn`` must be a module-level function returning what ``torch.save`` can write. If any
    rank raises, the others get a few seconds, then are stopped, and a ``RuntimeError``
    reports every rank's traceback.

    Args:
        fn: The per-rank function.
        world_size: Number of processes.
        *args: Extra picklable arguments passed to every rank.
        timeout: Seconds before the whole run is declared hung.
        start_method: ``"fork"`` inherits the parent's imports, so ranks start in
            milliseconds instead of the ~2.5-5 s a ``"spawn"`` interpreter spends importing
            torch and Lightning; safe for these single-threaded CPU/gloo workers. Use
            ``"spawn"`` once the parent process has touched CUDA.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, _to_bytes(args), results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes = _collect(results, procs, world_size, timeout)
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    failures = {rank: out for rank, (ok, out) in outcomes.items() if not ok}
    missing = sorted(set(range(world_size)) - set(outcomes))
    if failures or missing:
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        raise RuntimeError(
            f"{fn.__name__} failed on world size {world_size}; ranks without a"
            f" result (hung or killed): {missing}\n{report}"
        )
    return [
        torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)
    ]


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
            if not any(proc.is_alive() for proc in procs):
                break
            continue
        outcomes[rank] = (ok, out)
        if not ok:
            # Peers are likely blocked in a collective with the failed rank; let them time out
            # briefly so their own errors show, then stop waiting.
            deadline = min(deadline, time.monotonic() + 5.0)
    return outcomes
