"""Helpers for end-to-end tests: paths, and runners for the ``plugintrain`` CLI that never
leave a process behind.

:func:`run_cli` runs a command in a fresh interpreter (``python -m plugintrain ARGS``) by
default: what a user runs, with its ~8 s of imports (and Lightning's launcher starting
each further rank the same way). A test about what a command prints, writes, trains or
exits with, not about how its processes start, passes ``fresh_interpreter=False``: the
same entry point (``sys.argv``, then ``main()``) in children forked from the test
process's fork server (``tests/_processes.py``), which imported torch, Lightning and
plugintrain once. With ``ranks=N`` the command runs as ``torchrun --nproc_per_node N -m
plugintrain ARGS`` would run it: N children with torchrun's variables (rank, world size,
rendezvous address, run id), which Lightning takes for an external launcher's, so it
starts no ranks of its own. Tests of the launch itself (Lightning's launcher, torchrun,
kills and restarts) keep fresh interpreters.

A fresh command runs in a process group of its own (Lightning's launcher starts the other
ranks in it), and the whole group is killed when the command times out or the test is
interrupted (``_processes.run_command``); each forked rank has a group of its own, and
every group is killed the same way (``_processes.stop``).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch_env import reset_launch_environment
from _processes import adopt, context, run_command, stop

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 600,
    exit_code: int | None = 0,
    fresh_interpreter: bool = True,
    ranks: int = 1,
) -> subprocess.CompletedProcess:
    """Run ``plugintrain ARGS`` (see the module docstring for ``fresh_interpreter`` and
    ``ranks``); fail with its output unless it exits with ``exit_code`` (None: any status,
    for the caller to check) within ``timeout`` seconds."""
    if ranks < 1 or (ranks > 1 and fresh_interpreter):
        raise ValueError(f"ranks={ranks}: one or more, and more than one only forked")
    reset_launch_environment()  # a fixture may have trained in this process just before
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        if fresh_interpreter:
            proc = _run_fresh(args, cwd, env, timeout)
        else:
            proc = _run_forked(args, cwd, env, timeout, ranks)
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"plugintrain {' '.join(args)} did not finish within {timeout:.0f} s (killed"
            f" with everything it started):\n{error.stdout}\n{error.stderr}"
        )
    if exit_code is not None and proc.returncode != exit_code:
        pytest.fail(
            f"plugintrain {' '.join(args)} exited {proc.returncode}, not {exit_code}:\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _run_fresh(
    args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "plugintrain", *args]
    return run_command(command, cwd=cwd, env=env, timeout=timeout)


def _run_forked(
    args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float, ranks: int
) -> subprocess.CompletedProcess:
    """``args`` as ``ranks`` children of the fork server. The result holds rank 0's stdout,
    the other ranks' stdout and every rank's stderr (rank 0's last) in stderr, and the
    status of the first rank seen to fail (the others then have ``FAILED_RANK_GRACE``
    seconds to end by themselves before SIGKILL), or 0."""
    command = ["plugintrain", *args]
    envs, store = [env], None
    if ranks > 1:
        # The rendezvous store is held here, as torchrun's agent holds it, on a port the
        # kernel chose for it: the ranks all connect to it, none has to bind a port.
        store = dist.TCPStore("127.0.0.1", 0, ranks, True, wait_for_workers=False)
        # torchrun's default for several ranks per node: one intra-op thread each.
        env = {"OMP_NUM_THREADS": "1", **env}
        envs = [{**env, **_torchrun_variables(rank, ranks, store.port)} for rank in range(ranks)]
    with tempfile.TemporaryDirectory(prefix="plugintrain-cli-") as tmp:
        outputs = [(Path(tmp, f"stdout{r}"), Path(tmp, f"stderr{r}")) for r in range(ranks)]
        for path in (path for pair in outputs for path in pair):
            path.touch()  # read back even if a child dies before it opens them
        children = [
            context().Process(
                target=_cli_child, args=(list(args), str(cwd), rank_env, str(out), str(err))
            )
            for rank_env, (out, err) in zip(envs, outputs, strict=True)
        ]
        status = None
        try:
            for child in children:
                child.start()
            status = _first_failure(children, timeout)
        finally:
            stop(children, grace=FAILED_RANK_GRACE if status else 0)
        stdout = outputs[0][0].read_text(errors="replace")
        stderr = "".join(
            _rank_output(rank, out, err, ranks)
            for rank, (out, err) in reversed(list(enumerate(outputs)))
        )
    del store  # after every rank is gone
    if status is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, status, stdout, stderr)


def _rank_output(rank: int, out: Path, err: Path, ranks: int) -> str:
    """What a rank's stderr (and, for ranks after 0, stdout) adds to the command's stderr."""
    text = err.read_text(errors="replace")
    if ranks == 1:
        return text
    if rank:
        text = out.read_text(errors="replace") + text
    return f"[rank {rank} output]\n{text}" + ("" if text.endswith("\n") or not text else "\n")


FAILED_RANK_GRACE = 10.0
"""Seconds the other ranks of a forked command get to end by themselves after one failed."""


def _torchrun_variables(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What ``torchrun --nproc_per_node RANKS`` sets for ``rank`` on one node whose agent
    holds the rendezvous store on ``port`` (``TORCHELASTIC_RUN_ID`` is what Lightning
    detects torchrun by)."""
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(ranks), "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "forked",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def _first_failure(children: list[BaseProcess], timeout: float) -> int | None:
    """Wait until every child exited or one failed: the first nonzero status seen (a
    signal's as its negative number), 0, or None on a timeout."""
    deadline = time.monotonic() + timeout
    pending = {child.sentinel: child for child in children}
    while pending:
        ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        for sentinel in ready:
            status = pending.pop(sentinel).exitcode
            if status:
                return status
    return 0


def _cli_child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """``python -m plugintrain ARGS`` without the interpreter start: the caller's working
    directory, environment and arguments, stdout and stderr into files, ``sys.exit``'s
    status and the interpreter's exit handlers."""
    adopt(env)
    # What a fresh interpreter reads from its environment at start, the server did not.
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "RANK" in env:  # Lightning's rank-zero filter, set when Lightning was imported
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = int(env["RANK"])
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    import plugintrain

    sys.argv = [str(Path(plugintrain.__file__).with_name("__main__.py")), *args]
    status = _exit_status()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_status() -> int:
    """What the interpreter would exit with after ``sys.exit(main())``."""
    try:
        from plugintrain.cli import main

        code = main()
    except SystemExit as exit_request:
        code = exit_request.code
    except BaseException:
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def cli_error(*args: str, cwd: Path, timeout: float = 600) -> str:
    """Run ``python -m plugintrain ARGS``, which must fail as a user error: exit status 2,
    no traceback, no usage; returns the last line of stderr (the message)."""
    proc = run_cli(*args, cwd=cwd, timeout=timeout, exit_code=2)
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def logged_losses(log_dir: Path, tag: str = "train_loss") -> dict[int, float]:
    """Step -> value of a scalar in a TensorBoard run directory (``.../version_0``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}
