"""Helpers for end-to-end tests: paths, and a runner for the ``plugintrain`` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m plugintrain ARGS`` in a fresh process; fail with its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "plugintrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"plugintrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def logged_losses(log_dir: Path, tag: str = "train_loss") -> dict[int, float]:
    """Step -> value of a scalar in a TensorBoard run directory (``.../version_0``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}
