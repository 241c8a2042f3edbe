"""End to end: the hybrid recipe (dp=2 x tp=2 with SP and ZeRO-1) through the real CLI.

Launches of the same recipe: ``--trainer.devices 4`` on one machine (uninterrupted,
keeping every checkpoint), a simulated two-node ``torchrun`` (two commands, ``--nnodes 2
--node_rank 0|1``, 2 processes each, c10d rendezvous on 127.0.0.1), and a resume of the
first run's step-2 DCP checkpoint on tp2 alone with compiled blocks and selective
recomputation: losses must agree across all of them.
A single-process fit on the same global batches must end with the same weights. The
single-process fit and the resume (2 ranks, as torchrun starts them) are forked from the
fork server (``_cli.run_cli``). A torchrun node left waiting for a failed one is killed
with its workers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import kill_group

from plugintrain.checkpoints.dcp import read_weights

from _cli import RECIPES, REPO, logged_losses, run_cli

RECIPE = RECIPES / "llama3_debug_hybrid_cpu.yaml"
NAME = "llama3_debug_hybrid_cpu"
STEPS = 4
FAST = (
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=2",
    "--trainer.limit_val_batches=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--checkpoint.every_n_train_steps=2",
    "--checkpoint.save_top_k=-1",
    "--throughput.window_size=2",
)


def _losses(save_dir: Path) -> dict[int, float]:
    return logged_losses(save_dir / NAME / "version_0")


def _fit_args(data_dir: Path, save_dir: Path, *extra: str, recipe: Path = RECIPE) -> list[str]:
    return [
        "fit", "--config", str(recipe),
        f"--data.init_args.data_dir={data_dir}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        f"--trainer.max_steps={STEPS}", *FAST, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def single_node(shakespeare_llama3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 4-process run (``--trainer.devices 4``); returns its save dir."""
    save_dir = tmp_path_factory.mktemp("hybrid_single")
    run_cli(*_fit_args(shakespeare_llama3, save_dir), cwd=REPO)
    return save_dir


def test_devices_4_trains_and_writes_dcp_checkpoints(single_node: Path) -> None:
    losses = _losses(single_node)
    assert sorted(losses) == list(range(STEPS))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    last = single_node / NAME / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file()
    # Every rank wrote its own shards (one file per chunk, named __<rank>_<n>.distcp).
    assert {path.name.split("_")[2] for path in last.glob("*.distcp")} == {"0", "1", "2", "3"}


def test_two_node_torchrun_equals_single_node(
    single_node: Path, shakespeare_llama3: Path, tmp_path: Path
) -> None:
    port = _free_port()
    args = _fit_args(shakespeare_llama3, tmp_path, "--trainer.devices=2", "--trainer.num_nodes=2")
    nodes = [_torchrun_node(rank, port, args, tmp_path) for rank in (0, 1)]
    try:
        for node, log in nodes:
            code = node.wait(timeout=600)
            assert code == 0, log.read_text()
    finally:  # a node left waiting for a failed or hung one goes too, with its workers
        for node, _ in nodes:
            if node.poll() is None:
                kill_group(node.pid)
                node.wait()
    two_node, single = _losses(tmp_path), _losses(single_node)
    assert sorted(two_node) == sorted(single)
    for step, loss in two_node.items():
        assert loss == pytest.approx(single[step], rel=1e-5)


def test_weights_match_single_process_fit(
    single_node: Path, shakespeare_llama3: Path, tmp_path: Path
) -> None:
    """dp=2 x tp=2 on per-rank batches of 2 equals one process on batches of 4."""
    single_recipe = RECIPES / "llama3_debug_shakespeare_cpu.yaml"
    batch = "--data.init_args.batch_size=4"
    args = _fit_args(shakespeare_llama3, tmp_path, batch, recipe=single_recipe)
    run_cli(*args, cwd=REPO, fresh_interpreter=False)  # one process: forked, no imports
    single = torch.load(
        tmp_path / "llama3_debug_shakespeare_cpu" / "checkpoints" / "last.ckpt",
        weights_only=True,
    )["state_dict"]
    hybrid = read_weights(single_node / NAME / "checkpoints" / "last.ckpt")
    assert set(hybrid) == set(single)  # every weight saved, and nothing else
    # tp sums row-parallel partial products in another order than one process (last-bit
    # fp32 differences); AdamW's normalized steps grow them to ~1e-5 where a gradient is
    # near zero, so the weights are compared at 1e-4 (a wrong step is ~lr = 1e-3 or more).
    for name, weight in hybrid.items():
        torch.testing.assert_close(weight, single[name], rtol=1e-4, atol=1e-4, msg=name)


def test_compiled_resume_with_selective_recompute_equals_uninterrupted_run(
    single_node: Path, shakespeare_llama3: Path, tmp_path: Path
) -> None:
    """The dp2 x tp2 run's step-2 checkpoint resumed on tp2 alone (the same global batch in
    one replica) with ``compile: true`` (inductor's C++ backend on CPU) and selective
    recomputation, after tp + SP and before ZeRO-1, ends at the uninterrupted eager run's
    step-4 weights: steps 2 and 3 go through the compiled forward and backward from the
    restored weights, optimizer state, LR schedule and data position (a wrong one moves a
    weight by about lr = 1e-3). One launch: 2 processes start once, each compiles once.
    (Losses are not compared: a dp2 run logs its rank 0's half of the batch.)"""
    ckpt = single_node / NAME / "checkpoints" / "epoch=0-step=2.ckpt"
    extra = (
        f"--ckpt_path={ckpt}",
        "--trainer.devices=2",
        "--data.init_args.batch_size=4",
        "--trainer.strategy.init_args.compile=true",
        "--trainer.strategy.init_args.activation_checkpointing=selective",
    )
    run_cli(
        *_fit_args(shakespeare_llama3, tmp_path, *extra), cwd=REPO, fresh_interpreter=False, ranks=2
    )
    assert sorted(_losses(tmp_path)) == [2, 3]
    resumed = read_weights(tmp_path / NAME / "checkpoints" / "last.ckpt")
    uninterrupted = read_weights(single_node / NAME / "checkpoints" / "epoch=0-step=4.ckpt")
    assert set(resumed) == set(uninterrupted)
    # Fused kernels and one replica instead of two round differently in the last bits.
    for name, weight in resumed.items():
        torch.testing.assert_close(weight, uninterrupted[name], rtol=1e-4, atol=1e-4, msg=name)


def _torchrun_node(
    node_rank: int, port: int, args: list[str], tmp_path: Path
) -> tuple[subprocess.Popen, Path]:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun), "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=2",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=hybrid-e2e",
        "-m", "plugintrain", *args,
    ]  # fmt: skip
    log = tmp_path / f"node{node_rank}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, log


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
