"""Every strategy's checkpoint resumes under every other layout, from the CLI, exactly.

Four steps are trained under one layout (the same global batch of 4 sequences: one process
and pipeline pp=2 at batch 4, zero2 x2 and hybrid dp2 x tp2 at batch 2 per rank), then the run is
resumed under another layout and must log the next four losses of one uninterrupted
single-process run at batch 4: same weights, optimizer state, LR schedule and data
position (the samples the whole data-parallel group consumed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _cli import RECIPES, logged_losses, run_cli

STEPS = 8
LAYOUTS = {
    "one process": [
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--data.init_args.batch_size",
        "4",
    ],
    "zero2 x2": [
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "zero2",
        "--data.init_args.batch_size",
        "2",
    ],
    "pipeline pp2": [
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "pipeline",
        "--data.init_args.batch_size",
        "4",
    ],
    "hybrid dp2 x tp2": ["--trainer.devices", "4", "--data.init_args.batch_size", "2"],
}
RANKS = {
    layout: int(options[options.index("--trainer.devices") + 1])
    for layout, options in LAYOUTS.items()
}


def _fit(data: Path, out: Path, layout: str, max_steps: int, *extra: str) -> dict[int, float]:
    run_cli(
        "fit",
        "--config",
        str(RECIPES / "llama3_debug_hybrid_cpu.yaml"),
        "--data.init_args.data_dir",
        str(data),
        "--data.init_args.seq_len",
        "32",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--model.init_args.lr_decay_steps",
        str(STEPS),
        "--model.init_args.warmup_steps",
        "2",
        "--checkpoint.every_n_train_steps",
        "4",
        "--trainer.logger.init_args.save_dir",
        str(out),
        "--trainer.max_steps",
        str(max_steps),
        *LAYOUTS[layout],
        *extra,
        cwd=out.parent,
        fresh_interpreter=False,  # forked, as torchrun starts ranks: no imports
        ranks=RANKS[layout],
    )
    (version,) = (out / "llama3_debug_hybrid_cpu").glob("version_*")
    return logged_losses(version)


@pytest.fixture(scope="module")
def saved(
    shakespeare_llama3: Path,
    uninterrupted_llama3_run: tuple[dict[int, float], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """A four-step checkpoint of each layout. One process's is the step-4 checkpoint of the
    session's uninterrupted run (the same recipe, options and batches)."""
    root = tmp_path_factory.mktemp("resume_anywhere_saved")
    checkpoints = {"one process": uninterrupted_llama3_run[1] / "epoch=0-step=4.ckpt"}
    for layout in ("zero2 x2", "pipeline pp2", "hybrid dp2 x tp2"):
        out = root / layout.replace(" ", "_")
        _fit(shakespeare_llama3, out, layout, 4)
        checkpoints[layout] = out / "llama3_debug_hybrid_cpu" / "checkpoints" / "last.ckpt"
    # One process writes one file; the others a DCP directory of shards.
    for layout, checkpoint in checkpoints.items():
        assert checkpoint.is_file() == (layout == "one process"), checkpoint
    return checkpoints


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        # zero2 x2 resumed by one process: test_kill_during_save.py[zero2x2-replace:4].
        ("zero2 x2", "pipeline pp2"),
        ("pipeline pp2", "one process"),
        ("hybrid dp2 x tp2", "one process"),
        ("one process", "pipeline pp2"),  # a single file, read by each stage through DCP
    ],
)
def test_resume_continues_the_uninterrupted_run(
    saved, uninterrupted_llama3, shakespeare_llama3, tmp_path, saved_by, resumed_by
) -> None:
    out = tmp_path / "resumed"
    resumed = _fit(shakespeare_llama3, out, resumed_by, STEPS, "--ckpt_path", str(saved[saved_by]))
    assert sorted(resumed) == list(range(4, STEPS))
    for step in range(4, STEPS):
        assert resumed[step] == pytest.approx(uninterrupted_llama3[step], rel=1e-4), step
