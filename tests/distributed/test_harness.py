"""The harness itself (``_harness.run_distributed``): ranks join one gloo group with the
caller's environment, each in a process group of its own; a hung rank is killed and named;
nothing a rank started outlives the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _harness import run_distributed


def _joined(rank: int, world_size: int, marker: str) -> dict[str, object]:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {
        "sum": total.item(),
        "env": os.environ.get("HARNESS_PROBE"),
        "launch": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "own_group": os.getpgid(0) == os.getpid(),
        "marker": marker,
        "cwd": os.getcwd(),
    }


def _hangs_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _leaves_a_child(rank: int, world_size: int) -> int:
    """Starts a process that would outlive the rank; returns its pid."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]).pid


def test_ranks_join_one_group_with_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HARNESS_PROBE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    results = run_distributed(_joined, 3, "an argument")
    for rank, result in enumerate(results):
        assert result == {
            "sum": 6.0,
            "env": "set after the fork server started",
            "launch": (str(rank), "3"),
            "own_group": True,
            "marker": "an argument",
            "cwd": str(tmp_path),
        }


def test_a_hung_rank_is_killed_and_named() -> None:
    with pytest.raises(RuntimeError, match=r"within 2 s .* exit codes: \{1: -9\}"):
        run_distributed(_hangs_on_rank_1, 2, timeout=2)


def test_nothing_a_rank_started_outlives_the_run() -> None:
    pids = run_distributed(_leaves_a_child, 2)
    # SIGKILL is sent before run_distributed returns; the kernel ends a process when it
    # next runs, which on two busy cores can take a moment, not the hour it would sleep.
    deadline = time.monotonic() + 10.0
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        assert not _running(pid), f"process {pid} started by a rank is still running"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits to be reaped by init for a moment)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_every_preloaded_module_exists() -> None:
    """The fork server skips a name that fails to import, silently: a renamed module would
    only make every rank slower."""
    import importlib.util

    from _processes import PRELOAD

    assert [name for name in PRELOAD if importlib.util.find_spec(name) is None] == []
