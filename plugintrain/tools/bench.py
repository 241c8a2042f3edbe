"""``plugintrain bench --matrix FILE``: run a benchmark matrix, one process group per row.

Every configuration of the matrix (:mod:`plugintrain.bench.matrix`) runs as its own
command (``plugintrain fit`` with :class:`~plugintrain.bench.BenchRecorder` added, or a
baseline), so each gets a fresh process group and nothing one leaves behind (threads,
allocator state, a hung collective) touches the next. A configuration that fails or
times out is recorded with the last line it printed, and the matrix goes on.

Written into the output directory (``runs/bench/<matrix>-<time>`` unless ``--out``):
``results.json`` (one record per configuration, rewritten after each, so an interrupted
matrix keeps what it measured), ``results.md`` (the summary table), ``throughput.png``,
``memory.png`` and, where the device's peak is known, ``mfu.png``; each configuration's
output and rank files under ``<index>-<name>/``.

Exit status: 0 when every configuration ran, 1 when some failed, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from plugintrain.cli_messages import ConfigError


def bench(
    *, matrix: str, out: str | None = None, only: list[str] | None = None, list: bool = False
) -> int:
    """Run a benchmark matrix (YAML) and write JSON, Markdown and PNG results.

    Exit status: 0 when every configuration ran, 1 when some failed, 2 on bad input.

    Args:
        matrix: matrix file, e.g. benchmarks/cpu.yaml
        out: new output directory (default runs/bench/<matrix>-<time>)
        only: run only configurations whose name contains one of these (baseline kept)
        list: print the configurations and commands, run nothing
    """
    from plugintrain.bench.matrix import MatrixError, load_matrix

    try:
        configs = _select(load_matrix(matrix), only)
        folder = _output_dir(matrix, out)
    except MatrixError as error:
        raise ConfigError(str(error)) from None
    if list:
        for index, config in enumerate(configs):
            print(f"{index:>2} {config.name}\n   {config.shell(_row_dir(folder, index, config))}")
        return 0
    records = _run_matrix(configs, folder)
    return 0 if all(r["status"] == "ok" for r in records) else 1


def _select(configs: list[Any], only: list[str] | None) -> list[Any]:
    from plugintrain.bench.matrix import MatrixError

    if only is None:
        return configs
    chosen = [c for c in configs if c.baseline or any(t in c.name for t in only)]
    if not any(not c.baseline for c in chosen):
        names = ", ".join(repr(c.name) for c in configs)
        raise MatrixError(f"--only {' '.join(only)} matches no configuration; names: {names}")
    return chosen


def _output_dir(matrix: str, out: str | None) -> Path:
    """A directory no earlier run wrote into: results are never overwritten or mixed."""
    from plugintrain.bench.matrix import MatrixError

    if out is not None:
        path = Path(out)
        if path.exists() and any(path.iterdir()):
            raise MatrixError(
                f"--out {out} is not empty; pass a new directory so earlier results are kept"
            )
        return path
    base = Path("runs") / "bench" / f"{Path(matrix).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, suffix = base, 1
    while path.exists():  # two runs in one second
        path, suffix = base.with_name(f"{base.name}-{suffix}"), suffix + 1
    return path


def _row_dir(out: Path, index: int, config: Any) -> Path:
    slug = "".join(ch if ch.isalnum() else "-" for ch in config.name.lower()).strip("-")
    return out / f"{index:02d}-{slug}"


def _run_matrix(configs: list[Any], out: Path) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from plugintrain.bench.report import add_ratios, plots

    out.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    records: list[dict[str, Any]] = []
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("bench", total=len(configs))
        for index, config in enumerate(configs):
            progress.update(task, description=f"[{index + 1}/{len(configs)}] {config.name}")
            record = run_config(config, _row_dir(out, index, config))
            records.append(record)
            status = record["status"] if record["status"] == "ok" else f"failed: {record['error']}"
            progress.console.print(
                f"{config.name}: {status} ({record['seconds']:.0f} s)", soft_wrap=True, markup=False
            )
            progress.advance(task)
            baseline = add_ratios(records)
            _write(out, records, baseline, machine)
    written = plots(records, out)
    print((out / "results.md").read_text(), end="")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, " + ", ".join(map(str, written)))
    return records


def _write(out: Path, records: list[dict[str, Any]], baseline: str | None, machine: str) -> None:
    from plugintrain.bench.report import markdown

    document = {"machine": machine, "baseline": baseline, "records": records}
    (out / "results.json").write_text(json.dumps(document, indent=1))
    (out / "results.md").write_text(markdown(records, baseline, machine))


def run_config(config: Any, row_dir: Path) -> dict[str, Any]:
    """Run one configuration in its own process group; its record (failed ones too)."""
    from plugintrain.bench.report import merge_ranks

    row_dir.mkdir(parents=True, exist_ok=True)
    command = config.command(row_dir)
    record: dict[str, Any] = {
        "name": config.name,
        "baseline": config.baseline,
        "command": config.shell(row_dir),
        "status": "failed",
        "error": None,
    }
    start = time.perf_counter()
    error = _launch(config, command, row_dir)
    record["seconds"] = time.perf_counter() - start
    if error is None:
        try:
            record.update(merge_ranks(row_dir), status="ok")
        except (FileNotFoundError, ValueError) as failure:
            error = str(failure)
    record["error"] = error
    return record


def _launch(config: Any, command: list[str], row_dir: Path) -> str | None:
    """Run the command in a session of its own; None, or the error it ended with.

    Everything the command starts (Lightning's or torchrun's rank processes) shares its
    session, so a timeout, or ranks a failed launcher left behind, are stopped together:
    none lingers in a collective holding a GPU while the next row runs.
    """
    with (row_dir / "output.log").open("w") as log:
        proc = subprocess.Popen(
            command,
            env=_clean_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=config.timeout)
        except subprocess.TimeoutExpired:
            code = None
        _stop_session(proc)
    if code == 0:
        return None
    if code is None:
        return f"stopped after timeout={config.timeout:.0f} s"
    return _error_line(row_dir / "output.log") or f"exit status {code}"


def _clean_env() -> dict[str, str]:
    """This environment without a launcher's or scheduler's rank variables: inside a SLURM
    job or a torchrun worker, Lightning would join that job instead of launching the row."""
    inherited = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in inherited and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    return {**env, "PYTHONUNBUFFERED": "1"}


def _stop_session(proc: subprocess.Popen) -> None:
    """Terminate what is left of the command's session (nothing, after a clean exit)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _session_alive(proc.pid):
            time.sleep(0.2)
    proc.wait()


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _error_line(path: Path) -> str:
    """The line a failed run ended with: its last error line (a one-line user error, or the
    exception of a traceback), not a teardown warning printed after it."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [x for x in lines if "error:" in x or "Error" in x or "Exception" in x]
    return (errors or lines or [""])[-1]


def machine_name() -> str:
    """The devices a matrix ran on, in words (GPU model and count, or the CPU and cores)."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    from plugintrain.core.peak_flops import cpu_name

    cpu = cpu_name()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
