"""Helpers for end-to-end tests: paths, and runners for the ``plugintrain`` CLI that never
leave a process behind.

:func:`run_cli` runs a command in a fresh interpreter (``python -m plugintrain ARGS``) by
default: what a user runs, with its ~8 s of imports. A test about what a one-process
command prints, writes or exits with, not about processes, passes
``fresh_interpreter=False``: the same entry point (``sys.argv``, then ``main()``) in a
child forked from the test process's fork server (``tests/_processes.py``), which
imported torch, Lightning and plugintrain once. Launches of several ranks, torchrun, kills
and restarts keep fresh interpreters.

Every command runs in a process group of its own (Lightning's launcher starts the other
ranks in it), and the whole group is killed when the command times out or the test is
interrupted (``_processes.run_command``).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from multiprocessing.connection import wait
from pathlib import Path

import pytest
from _launch_env import reset_launch_environment
from _processes import adopt, context, run_command, stop

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 600,
    exit_code: int = 0,
    fresh_interpreter: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``plugintrain ARGS`` (see the module docstring for ``fresh_interpreter``); fail
    with its output unless it exits with ``exit_code`` within ``timeout`` seconds."""
    reset_launch_environment()  # a fixture may have trained in this process just before
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = _run_fresh if fresh_interpreter else _run_forked
    try:
        proc = run(args, cwd, env, timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"plugintrain {' '.join(args)} did not finish within {timeout:.0f} s (killed"
            f" with everything it started):\n{error.stdout}\n{error.stderr}"
        )
    if proc.returncode != exit_code:
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
    args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="plugintrain-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = context().Process(
            target=_cli_child, args=(list(args), str(cwd), env, str(out), str(err))
        )
        try:
            child.start()
            timed_out = not wait([child.sentinel], timeout)  # not reaped yet: see stop()
        finally:
            stop([child], grace=0)
        stdout, stderr = out.read_text(), err.read_text()
    if timed_out:
        raise subprocess.TimeoutExpired(["plugintrain", *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["plugintrain", *args], child.exitcode, stdout, stderr)


def _cli_child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """``python -m plugintrain ARGS`` without the interpreter start: the caller's working
    directory, environment and arguments, stdout and stderr into files, ``sys.exit``'s
    status and the interpreter's exit handlers."""
    adopt(env)
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
