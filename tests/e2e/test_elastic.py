"""Elastic restart: under ``torchrun --max-restarts 1`` a job that loses a worker resumes
from its last complete checkpoint by itself and ends with the uninterrupted run's weights.

Four steps with a checkpoint every two: rank 1 dies after step 3, one step past step 2's
checkpoint, which the restarted workers find by themselves and train on from. The
uninterrupted reference is the same command as forked torchrun-like ranks
(``run_cli(..., ranks=2)``): its subject is the weights, not the launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import run_command

from plugintrain.checkpoints.dcp import read_weights

from _cli import RECIPES, REPO, run_cli


def _fit_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
        "--data.init_args.data_dir", str(data), "--data.init_args.seq_len", "32",
        "--data.init_args.batch_size", "2", "--trainer.devices", "2",
        "--trainer.strategy", "zero2", "--trainer.max_steps", "4",
        "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--checkpoint.every_n_train_steps", "2",
        "--trainer.logger.init_args.save_dir", str(out), *extra,
    ]  # fmt: skip


def _torchrun(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "plugintrain",
        *_fit_args(data, out, *extra),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    try:  # torchrun and its workers killed together on a timeout
        proc = run_command(command, cwd=out.parent, env=env, timeout=900)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun did not finish in 900 s:\n{error.stdout}\n{error.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def test_a_killed_worker_restarts_from_the_last_checkpoint(shakespeare_gpt2, tmp_path) -> None:
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    run_cli(*_fit_args(shakespeare_gpt2, clean), cwd=tmp_path, fresh_interpreter=False, ranks=2)
    kill = '{"class_path": "tests.e2e._faults.KillOnce", "init_args": {"step": 3, "rank": 1}}'
    proc = _torchrun(shakespeare_gpt2, killed, f"--trainer.callbacks+={kill}")
    assert "resuming from" in proc.stdout + proc.stderr  # the restart found step 2 by itself
    checkpoints = "gpt2_debug_shakespeare_cpu/checkpoints/last.ckpt"
    expected, got = read_weights(clean / checkpoints), read_weights(killed / checkpoints)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
