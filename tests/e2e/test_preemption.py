"""Preemption and SLURM: a SIGTERM (a scheduler's) or SIGUSR1 (SLURM's warning before a
time limit) at a random micro-batch finishes the optimizer step in progress, saves it
through the normal atomic path and exits 143 / 138; ``--ckpt_path last`` resumes there
and ends with the uninterrupted run's weights (atol 1e-6) and losses. Under SLURM (its
variables set for 2 "nodes" x 2 tasks on this machine, read by Lightning's
``SLURMEnvironment``) the run equals one process, and SIGUSR1 requeues the job through
``scontrol`` (a stand-in on PATH records the call).

The random batch is drawn per test session and printed in every failure message.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _runs import forked

from plugintrain.checkpoints.dcp import ChunkByChunkReader, read_rest, read_weights
from plugintrain.checkpoints.files import is_complete, load_torch_file

from _cli import RECIPES, REPO, logged_losses, run_cli

STEPS = 6
SEED = int(os.environ.get("PLUGINTRAIN_TEST_SEED", random.randrange(2**31)))
DRAW = random.Random(SEED)  # PLUGINTRAIN_TEST_SEED=N replays a failure's draw
GPT2 = RECIPES / "gpt2_debug_shakespeare_cpu.yaml"
FAST = [
    "--data.init_args.seq_len=32", "--trainer.limit_val_batches=0",
    "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--checkpoint.every_n_train_steps=1000",
    f"--trainer.max_steps={STEPS}",
]  # fmt: skip
LAYOUTS = {  # name -> (recipe, options, micro-batches per optimizer step)
    "zero2": (GPT2, ["--trainer.strategy=zero2", "--trainer.devices=2",
                     "--trainer.accumulate_grad_batches=2", "--data.init_args.batch_size=2"], 2),
    "pipeline": (RECIPES / "gpt2_debug_pipeline_cpu.yaml",
                 ["--trainer.strategy.init_args.microbatches=2",
                  "--data.init_args.batch_size=2"], 1),
}  # fmt: skip


def _args(layout: str, data: Path, out: Path, *extra: str) -> list[str]:
    recipe, options, _ = LAYOUTS[layout]
    return [
        "fit", "--config", str(recipe), f"--data.init_args.data_dir={data}",
        f"--trainer.logger.init_args.save_dir={out}", *FAST, *options, *extra,
    ]  # fmt: skip


def _signal_at(batch: int, rank: int, name: str) -> str:
    fault = {"class_path": "_faults.SignalAt",
             "init_args": {"batch": batch, "rank": rank, "signal": name}}  # fmt: skip
    return f"--trainer.callbacks+={json.dumps(fault)}"


def _last(out: Path) -> Path:
    return next(out.glob("*/checkpoints")) / "last.ckpt"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        return read_weights(path)
    return load_torch_file(path, map_location="cpu")["state_dict"]


def _saved_step(path: Path) -> int:
    assert is_complete(path), f"{path} is incomplete"
    if path.is_dir():
        return read_rest(ChunkByChunkReader(path))["global_step"]
    return load_torch_file(path, map_location="cpu")["global_step"]


def _losses(out: Path) -> dict[int, float]:
    """Every version's logged losses, later versions (the resumed run) over earlier ones."""
    losses: dict[int, float] = {}
    for version in sorted(next(out.glob("*/")).glob("version_*"), key=lambda p: int(p.name[8:])):
        losses.update(logged_losses(version))
    return losses


def _assert_same_run(got: Path, expected: Path, why: str) -> None:
    """Same final weights (atol 1e-6) and the same loss at every step."""
    reference, weights = _weights(_last(expected)), _weights(_last(got))
    assert weights.keys() == reference.keys(), why
    for name, weight in weights.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-6, msg=f"{name}; {why}")
    reference_losses, losses = _losses(expected), _losses(got)
    assert sorted(losses) == sorted(reference_losses) == list(range(STEPS)), why
    for step, loss in losses.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-6), (
            f"step {step}; {why}"
        )


@pytest.mark.parametrize("layout", ["zero2", "pipeline"])
def test_sigterm_saves_the_step_and_last_resumes_it_exactly(layout, shakespeare_gpt2, tmp_path):
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    run_cli(*_args(layout, shakespeare_gpt2, clean), cwd=tmp_path, fresh_interpreter=False, ranks=2)
    per_step = LAYOUTS[layout][2]
    batch = DRAW.randrange(0, (STEPS - 1) * per_step)  # any micro-batch before the last step
    why = f"SIGTERM to rank 1 at the start of micro-batch {batch} (PLUGINTRAIN_TEST_SEED={SEED})"
    args = _args(layout, shakespeare_gpt2, stopped)
    proc = run_cli(*args, _signal_at(batch, 1, "SIGTERM"), cwd=tmp_path, exit_code=143,
                   fresh_interpreter=False, ranks=2)  # fmt: skip
    step = batch // per_step + 1  # the optimizer step in progress, finished
    assert f"stopped by SIGTERM after step {step}; checkpoint" in proc.stderr, (
        f"{why}\n{proc.stderr}"
    )
    assert _saved_step(_last(stopped)) == step, why
    run_cli(*args, "--ckpt_path=last", cwd=tmp_path, fresh_interpreter=False, ranks=2)
    _assert_same_run(stopped, clean, why)


# -- SLURM ---------------------------------------------------------------------------------

SLURM_ARGS = ["--trainer.strategy=zero2", "--trainer.num_nodes=2", "--trainer.devices=2",
              "--data.init_args.batch_size=2"]  # fmt: skip


def _srun(
    data: Path, out: Path, *extra: str, env: dict[str, str] | None = None, pids: Path | None = None
) -> list[int]:
    """The command as ``srun`` starts it on 2 nodes x 2 tasks: the ranks' exit statuses
    (their process ids written to ``pids``, for the stand-in ``scontrol``)."""
    args = ["fit", "--config", str(GPT2), f"--data.init_args.data_dir={data}",
            f"--trainer.logger.init_args.save_dir={out}", *FAST, *SLURM_ARGS, *extra]  # fmt: skip
    run = forked(args, out.parent, 4, slurm_nodes=2, env=env)
    if pids is not None:
        pids.write_text(" ".join(map(str, run.pids)))
    took = run.finish(600)
    assert took is not None, f"the SLURM run hung:\n{run.output}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "output.txt").write_text(run.output)
    return run.statuses


@pytest.fixture(scope="module")
def slurm_run(shakespeare_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2 x 2 SLURM run, started with ``--ckpt_path last`` as the sbatch
    scripts start every attempt (the first finds no checkpoint and starts fresh)."""
    out = tmp_path_factory.mktemp("slurm") / "runs"
    statuses = _srun(shakespeare_gpt2, out, "--ckpt_path=last")
    assert statuses == [0] * 4, (out / "output.txt").read_text()
    return out


def test_slurm_2x2_equals_one_process(slurm_run, shakespeare_gpt2, tmp_path):
    """4 SLURM tasks on per-rank batches of 2 end with the weights of one process on
    batches of 8. ZeRO-2 sums 4 partial gradients in another order: last-bit differences
    (2e-7 here), which AdamW's normalized steps grow to 2e-5 where a gradient is near zero
    (2 embedding rows), so 1e-4 as for the hybrid launch; a wrong step moves a weight by
    about lr = 3e-3."""
    args = ["fit", "--config", str(GPT2), f"--data.init_args.data_dir={shakespeare_gpt2}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", *FAST,
            "--data.init_args.batch_size=8"]  # fmt: skip
    run_cli(*args, cwd=tmp_path, fresh_interpreter=False)
    single, slurm = _weights(_last(tmp_path)), _weights(_last(slurm_run))
    assert single.keys() == slurm.keys()
    for name, weight in slurm.items():
        torch.testing.assert_close(weight, single[name], rtol=1e-4, atol=1e-4, msg=name)


def test_slurm_sigusr1_saves_requeues_and_the_requeued_job_resumes(
    slurm_run, shakespeare_gpt2, tmp_path
):
    """SLURM's ``--signal=USR1@90`` reaches every task; rank 0 requeues the job once
    (``scontrol requeue 4242``, which, as SLURM does, then sends SIGTERM to every task:
    ignored, the stop is under way) while the others wait, every task exits 138, and the
    requeued job (the same command, ``SLURM_RESTART_COUNT=1``) resumes from the saved step
    to the uninterrupted run's weights."""
    bin_dir, calls, pids = tmp_path / "bin", tmp_path / "scontrol_calls", tmp_path / "pids"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nkill -TERM $(cat {pids})\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "runs"
    batch = DRAW.randrange(0, STEPS - 1)
    why = f"SIGUSR1 to every task at the start of batch {batch} (PLUGINTRAIN_TEST_SEED={SEED})"
    usr1 = [_signal_at(batch, rank, "SIGUSR1") for rank in range(4)]
    statuses = _srun(shakespeare_gpt2, out, "--ckpt_path=last", *usr1, env=env, pids=pids)
    output = (out / "output.txt").read_text()
    assert statuses == [138] * 4, f"{why}\n{output}"
    assert calls.read_text().splitlines() == ["requeue 4242"], f"{why}\n{output}"
    assert re.search(
        rf"stopped by SIGUSR1 after step {batch + 1}; checkpoint .*; SLURM job requeued", output
    ), output
    assert _saved_step(_last(out)) == batch + 1, why
    statuses = _srun(
        shakespeare_gpt2, out, "--ckpt_path=last", env={**env, "SLURM_RESTART_COUNT": "1"}
    )
    assert statuses == [0] * 4, (out / "output.txt").read_text()
    _assert_same_run(out, slurm_run, why)


@pytest.mark.parametrize(
    "script", sorted((RECIPES / "slurm").glob("*.sbatch")), ids=lambda p: p.name
)
def test_sbatch_scripts_are_valid_and_name_only_options_the_code_reads(script: Path, tmp_path):
    """``bash -n``; the ``plugintrain fit`` command parses (``--print_config``: every option
    exists, every value has its type) with SLURM's variables as a job sees them; and the
    job is preemptible the way the code expects (USR1 ahead of the limit, requeue)."""
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.MULTILINE))
    assert directives.get("signal", "").startswith("USR1@") and "requeue" in directives
    command = re.search(r"^srun .*?plugintrain (fit .*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    assert command, "no `srun ... plugintrain fit` line"
    nodes, tasks = directives["nodes"], directives["ntasks-per-node"]
    line = command.group(1).replace("\\\n", " ")
    line = line.replace("${SLURM_JOB_NUM_NODES}", nodes).replace("${SLURM_NTASKS_PER_NODE}", tasks)
    args = [a.strip('"') for a in line.split()]
    assert "$" not in " ".join(args), f"an unsubstituted variable in {args}"
    proc = run_cli(*args, "--print_config", cwd=REPO, fresh_interpreter=False)
    config = proc.stdout
    assert f"num_nodes: {nodes}\n" in config, config
    assert re.search(rf"devices: '?{tasks}'?\n", config), config
    shutil.rmtree(tmp_path, ignore_errors=True)
