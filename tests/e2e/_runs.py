"""Multi-process runs that a test starts, watches and signals while they train: N ranks
forked from the fork server with torchrun's variables (the rendezvous store held by the
test, as torchrun's agent holds it) or with SLURM's (as ``srun`` starts one task per
device), or one ``python -m plugintrain`` command whose ranks Lightning's own launcher
starts, in a session of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from _launch_env import reset_launch_environment
from _processes import context, kill_group, stop

from _cli import _cli_child, _torchrun_variables


def slurm_variables(rank: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    """What ``srun --nodes NODES --ntasks-per-node PER_NODE`` sets for task ``rank`` (as
    Lightning's ``SLURMEnvironment`` reads them), every "node" on this machine."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "plugintrain-test",
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node), "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


@dataclass
class Run:
    """A started run: its processes (``pids[0]`` is rank 0), and how it ended."""

    pids: list[int]
    wait_all: Callable[[float], list[int] | None]
    outputs: Callable[[], str]
    cleanup: Callable[[], None]
    statuses: list[int] = field(default_factory=list)
    output: str = ""

    def signal(self, signum: int, target: str) -> None:
        """``signum`` to ``group`` (every rank), ``rank0`` or ``rank1``."""
        pids = self.pids if target == "group" else [self.pids[0 if target == "rank0" else 1]]
        for pid in pids:
            os.kill(pid, signum)

    def finish(self, timeout: float) -> float | None:
        """Seconds until every process is gone (None: still there after ``timeout``, then
        killed); their exit statuses in :attr:`statuses`, what they printed in
        :attr:`output`."""
        start = time.monotonic()
        statuses = self.wait_all(timeout)
        elapsed = time.monotonic() - start
        self.output = self.outputs()
        self.cleanup()
        self.statuses = statuses or []
        return elapsed if statuses is not None else None


def forked(
    args: list[str],
    cwd: Path,
    ranks: int,
    slurm_nodes: int | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """``plugintrain ARGS`` as ``ranks`` forked ranks, torchrun's (or, with
    ``slurm_nodes``, srun's) variables, ``env`` over this process's environment."""
    reset_launch_environment()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    store = dist.TCPStore("127.0.0.1", 0, ranks, True, wait_for_workers=False)
    if slurm_nodes is None:
        envs = [{**env, **_torchrun_variables(r, ranks, store.port)} for r in range(ranks)]
    else:
        envs = [{**env, **slurm_variables(r, slurm_nodes, ranks // slurm_nodes, store.port),
                 "TORCHELASTIC_USE_AGENT_STORE": "True"} for r in range(ranks)]  # fmt: skip
    tmp = tempfile.TemporaryDirectory(prefix="plugintrain-run-")
    files = [(Path(tmp.name, f"out{r}"), Path(tmp.name, f"err{r}")) for r in range(ranks)]
    for path in (p for pair in files for p in pair):
        path.touch()
    children = [
        context().Process(target=_cli_child, args=(args, str(cwd), e, str(o), str(err)))
        for e, (o, err) in zip(envs, files, strict=True)
    ]
    for child in children:
        child.start()

    def wait_all(timeout: float) -> list[int] | None:
        deadline = time.monotonic() + timeout
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        if any(child.is_alive() for child in children):
            return None
        return [child.exitcode for child in children]

    def outputs() -> str:
        return "".join(
            f"[rank {r}]\n{o.read_text()}{e.read_text()}" for r, (o, e) in enumerate(files)
        )

    def cleanup() -> None:
        stop(children, grace=0)
        tmp.cleanup()
        del store_ref[:]

    store_ref = [store]  # the store lives until every rank is gone
    return Run([c.pid for c in children], wait_all, outputs, cleanup)


def launched(args: list[str], cwd: Path) -> Run:
    """``python -m plugintrain ARGS`` in a session of its own; Lightning's launcher starts
    ranks 1.. as its children, found once they exist."""
    reset_launch_environment()
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (read and removed by the Run)
        prefix="plugintrain-launch-", suffix=".log", delete=False
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "plugintrain", *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )  # fmt: skip
    run = Run([proc.pid], lambda t: None, lambda: Path(log.name).read_text(), lambda: None)

    def group_alive() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return False
        return _group_members(proc.pid) != []

    def wait_all(timeout: float) -> list[int] | None:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            status = proc.poll() if status is None else status
            if status is not None and not group_alive():
                return [status]
            time.sleep(0.1)
        return None

    def cleanup() -> None:
        kill_group(proc.pid)
        proc.wait()
        os.unlink(log.name)

    run.wait_all, run.cleanup = wait_all, cleanup
    return run


def children_of(run: Run, count: int, timeout: float = 60) -> None:
    """Add the ranks Lightning's launcher started (children of ``run.pids[0]``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in _group_members(run.pids[0]) if p != run.pids[0]]
        if len(found) >= count:
            run.pids = [run.pids[0], *sorted(found)[:count]]
            return
        time.sleep(0.2)
    raise TimeoutError(f"the launcher started no {count} ranks within {timeout} s")


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members
