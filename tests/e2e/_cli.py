"""Helpers for end-to-end tests: paths, and a runner for the ``plugintrain`` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch_env import reset_launch_environment

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def run_cli(
    *args: str, cwd: Path, timeout: float = 600, exit_code: int = 0
) -> subprocess.CompletedProcess:
    """Run ``python -m plugintrain ARGS`` in a fresh process; fail with its output unless it
    exits with ``exit_code``."""
    reset_launch_environment()  # a fixture may have trained in this process just before
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "plugintrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != exit_code:
        pytest.fail(
            f"plugintrain {' '.join(args)} exited {proc.returncode}, not {exit_code}:\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    return proc


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
