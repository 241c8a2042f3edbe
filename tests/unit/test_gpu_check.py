"""``make gpu-check`` on a machine without CUDA, and its checks' code on the CPU.

Without a GPU the command is a dry run that says so and exits 0. The check functions take
the device, so here they run CPU against CPU: the comparisons are trivially equal, what is
tested is that every check runs and reports; their meaning comes on CUDA, in the ``gpu``
tier (tests/gpu).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugintrain.bench import gpu_checks
from plugintrain.cli import main
from plugintrain.tools import gpu_check

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_without_cuda_it_is_a_dry_run_that_says_so(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    lines = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert main(["gpu-check", "--out", str(out)]) == 0
    assert lines[0].startswith("gpu-check: no CUDA device here")
    assert "Dry run: nothing was checked" in lines[0]
    assert lines[1] == gpu_check.NCCL_NOTE and "NCCL" in lines[1]
    assert not out.exists()  # no table pretending to be a result


def test_the_make_target_runs_the_module() -> None:
    # Under `make test` this runs as a sub-make, which would print its directory.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert recipe[-1] == ".venv/bin/python -m plugintrain.tools.gpu_check"


def test_the_command_exits_0_on_a_machine_without_cuda() -> None:
    # Hiding the GPUs makes any machine one without CUDA for the child process.
    done = subprocess.run(
        [sys.executable, "-m", "plugintrain.tools.gpu_check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout and "NCCL" in done.stdout


def test_a_run_writes_one_table_as_json(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "_machine", lambda: {"device": "test", "torch": "", "cuda": ""})
    run_on_cpu = gpu_checks.run_checks
    monkeypatch.setattr(gpu_checks, "run_checks", lambda device, _: run_on_cpu(CPU, ["logits"]))
    out = tmp_path / "report.json"
    assert main(["gpu-check", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["checks"]] == list(gpu_checks.FAMILIES)
    assert all(c["ok"] for c in report["checks"]) and report["not_checked"] == gpu_check.NCCL_NOTE
    printed = capsys.readouterr().out
    assert "6 of 6 checks passed" in printed and gpu_check.NCCL_NOTE in printed


def test_a_check_that_raises_is_a_failed_row(monkeypatch) -> None:
    def broken(name: str, device: torch.device) -> gpu_checks.Check:
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(gpu_checks, "strategy_parity", broken)
    rows = gpu_checks.run_checks(CPU, ["strategy"])
    assert [(r["name"], r["ok"]) for r in rows] == [(s, False) for s in gpu_checks.STRATEGIES]
    assert rows[0]["detail"] == "RuntimeError: no kernel image is available"


@pytest.mark.parametrize("family", gpu_checks.FAMILIES)
def test_logits_check_runs(family: str) -> None:
    check = gpu_checks.logits_parity(family, CPU)
    assert check.ok and check.figures["max_abs_diff"] == 0.0


def test_precision_and_strategy_checks_run() -> None:
    trains = gpu_checks.precision_trains("bf16-true", CPU)
    assert trains.ok, trains.detail
    parity = gpu_checks.strategy_parity("pipeline", CPU)
    assert parity.ok and parity.figures["losses"] == list(parity.figures["cpu_losses"])


def test_throughput_check_reports_its_figures(monkeypatch) -> None:
    monkeypatch.setitem(gpu_checks.THROUGHPUT_RUNS, "gpt2-debug", (2, 16))
    check = gpu_checks.throughput("gpt2-debug", CPU, steps=2, warmup=1)
    figures = check.figures
    assert figures["tokens_per_s"] > 0 and figures["peak_bytes"] > 0
    assert figures["mfu"] is None  # no known peak for a CPU
    assert figures["tokens_per_s"] == 32 / statistics.median(figures["step_seconds"])


def test_throughput_figures_from_a_record() -> None:
    record = {
        "step_seconds": [0.5, 0.4, 0.6], "tokens_per_step": 8192, "peak_flops": 1e15,
        "flops_per_token": 10**9, "peak_bytes": 3 * 2**30, "device": "NVIDIA H200", "loss": 7.0,
    }  # fmt: skip
    check = gpu_checks._throughput_check("gpt2-124m", record)
    assert check.figures["tokens_per_s"] == 8192 / 0.5  # the median step
    assert check.figures["mfu"] == pytest.approx(1e9 * 8192 / 0.5 / 1e15)
    assert check.detail == "16,384 tokens/s, MFU 1.6%, peak memory 3.0 GiB"


@pytest.mark.parametrize("kind", gpu_checks.QUANTIZATIONS)
def test_qlora_check_runs(kind: str) -> None:
    check = gpu_checks.qlora_parity(kind, CPU)  # the device is the CPU: equal by definition
    assert check.ok and check.figures["diffs"] == [0.0, 0.0, 0.0], check.detail


def test_qlora_throughput_row_reports_its_figures(monkeypatch) -> None:
    monkeypatch.setitem(gpu_checks.QLORA_RUNS, "llama3-debug qlora nf4", ("llama3-debug", 2, 16))
    check = gpu_checks.qlora_throughput("llama3-debug qlora nf4", CPU, steps=2, warmup=1)
    assert (check.section, check.name) == ("qlora", "llama3-debug qlora nf4")
    assert check.figures["tokens_per_s"] > 0 and check.figures["peak_bytes"] > 0
