"""Processes that tests start: quickly, safely under pytest-xdist, and none left behind.

Importing torch, Lightning and plugintrain costs a fresh interpreter about 8 s on two
cores, so forking the test process would be the quick way to start a rank or a command;
but a pytest-xdist worker has threads of its own (execnet's), and a child forked while one
of them holds a lock waits for it forever (seen once in three ``make test`` runs). The
fork server of :mod:`multiprocessing` (``"forkserver"``) is a fresh interpreter, started
once per test process, that imports :data:`PRELOAD` and then forks each child from its
single thread. A child gets the test's ``sys.path`` and working directory from
multiprocessing; :func:`adopt` gives it the test's environment too (the server keeps the
one it started with) and a process group of its own.

Nothing a test starts outlives it: :func:`stop` kills a child's whole process group after
a grace period, and :func:`run_command` (``subprocess.run`` for commands that launch
ranks: Lightning's launcher, torchrun) starts a command in a session of its own and kills
the session's group on a timeout or an interrupt. ``subprocess.run`` alone kills only the
command, and a rank it started, waiting for the dead one, would keep the output pipes,
and the test, open until gloo's own timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = (
    "pytest", "torch", "torch.distributed", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "lightning",
    "lightning.pytorch", "transformers", "plugintrain.lightning_cli",
    "plugintrain.strategies.hybrid", "plugintrain.strategies.zero", "plugintrain.model_zoo.lm",
    "plugintrain.data.datamodules.token_datamodule", "plugintrain.formats", "plugintrain.callbacks",
)  # fmt: skip
"""What the server imports once so that no child imports it again (the package faces are
lazy, so the modules behind them are named: the Lightning CLI, the strategies, which
register their names when imported, the causal LM, the token data). A name that fails to
import is skipped by the server; the child then imports it itself and reports the error."""


def context(start_method: str = "forkserver") -> BaseContext:
    """The multiprocessing context for ``start_method``; the fork server preloads
    :data:`PRELOAD` (read when the server starts, with this process's first child)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def adopt(env: dict[str, str]) -> None:
    """In a child: the caller's environment ``env`` instead of the server's, and a process
    group of its own, so that stopping the child stops whatever it started too."""
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(env)


def stop(procs: list[BaseProcess], grace: float) -> None:
    """Every process in ``procs`` and its process group gone: ``grace`` seconds to exit by
    itself, then SIGKILL, also when the wait is interrupted. A child's group keeps its
    pid as long as any process of the group lives, so killing the group reaches what an
    exited child left running. A child stopped before it made its own group (see
    :func:`adopt`) is killed by its pid, which the fork server has not reaped yet."""
    started = [proc for proc in procs if proc.pid is not None]
    deadline = time.monotonic() + grace
    pending = {proc.sentinel: proc for proc in started}
    try:
        while pending and time.monotonic() < deadline:
            for sentinel in wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                del pending[sentinel]
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # a hung child, or what it left running
            if not wait([proc.sentinel], timeout=0.1):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGKILL)  # still in the server's group
            proc.join()


def run_command(
    command: Sequence[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in a session of its own
    (``env`` None: this process's environment); on a timeout (``subprocess.TimeoutExpired``,
    with the output so far) or an interrupt, the command and everything it started are
    killed first."""
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as error:
            kill_group(proc.pid)
            stdout, stderr = proc.communicate()  # the pipes close once the group is gone
            if isinstance(error, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (a command started in a new session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
