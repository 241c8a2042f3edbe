"""Context parallelism through the command line, against one process (issue 46).

Every run is ``plugintrain fit`` on real tokens, forked from the fork server as torchrun
starts its ranks (``_cli.run_cli``), with SGD (lr 3, gradient clipping at 1) for 3 steps
at fp32, then one validation batch. SGD moves each weight by its gradient, so the final
weights compare the gradients themselves (AdamW's normalized steps would blow last-bit
differences up where a gradient is near zero). Each layout's final weights must be the one
process's within 1e-5 of each tensor's largest value, and, where every rank sees the whole
batch (no dp), its logged training and validation losses within 1e-5 relative. A layout
with dp 2 reads per-rank batches of 2 against one process's batch of 4, and its rank 0
logs its own half's loss, so only its weights are compared. A cp2 checkpoint resumes in
one process at the uninterrupted run's weights.

- Llama 3 debug (GQA, RoPE) on Shakespeare, rows of 32: cp4; cp2 x tp2 with sequence
  parallelism and full recomputation; cp2 x pp2 under 1F1B, GPipe and the interleaved
  schedule (2 virtual stages a rank); cp2 with FSDP2; cp2 x dp2 with ZeRO-2.
- DeepSeek-V3 debug (MLA, MoE with the sequence-wise balance loss): cp2 x ep2 (dp 2).
- GPT-2 debug (learned positions) with LoRA on packed, loss-masked chat rows of 64, with
  2 accumulated micro-batches a step: cp2 (documents that cross the cp split).

A layout that cannot run is refused in one line before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from plugintrain.checkpoints.dcp import read_weights
from plugintrain.cli import main

from _cli import RECIPES, REPO, logged_losses, run_cli

STEPS = 3
HYBRID = "plugintrain.strategies.HybridParallelStrategy"
SGD = {
    "model": {
        "init_args": {
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 3.0}},
            "warmup_steps": 0,
        }
    }
}
QUIET = (
    f"--trainer.max_steps={STEPS}",
    "--trainer.limit_val_batches=1",
    f"--trainer.val_check_interval={STEPS}",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.gradient_clip_val=1.0",
)


def _strategy(tmp: Path, name: str, **options: object) -> Path:
    path = tmp / f"{name}.yaml"
    strategy = {"class_path": HYBRID, "init_args": options}
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    return path


def _fit(
    tmp: Path, recipe: Path, name: str, data: list[str], ranks: int, layout: Path | None
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Fit ``recipe`` on ``ranks`` forked ranks with SGD (and the ``layout`` file); its
    logged training and validation losses (step -> loss, the validation's at step -1) and
    final weights (whatever the checkpoint holds)."""
    sgd = tmp / "sgd.yaml"
    sgd.write_text(yaml.safe_dump(SGD))
    out = tmp / name
    args = ["fit", "--config", str(recipe), "--config", str(sgd)]
    args += ["--config", str(layout)] if layout is not None else []
    args += [
        *data,
        *QUIET,
        f"--trainer.devices={ranks}",
        f"--trainer.logger.init_args.save_dir={out}",
    ]
    run_cli(*args, cwd=tmp, fresh_interpreter=False, ranks=ranks)
    (run,) = out.iterdir()
    last = run / "checkpoints" / "last.ckpt"
    weights = (
        read_weights(last) if last.is_dir() else torch.load(last, weights_only=True)["state_dict"]
    )
    losses = logged_losses(run / "version_0")
    val = logged_losses(run / "version_0", "val_loss")
    losses[-1] = val[max(val)]  # the last validation's
    return losses, weights


def _assert_same(
    got: tuple[dict[int, float], dict[str, torch.Tensor]],
    want: tuple[dict[int, float], dict[str, torch.Tensor]],
    losses: bool = True,
) -> None:
    if losses:
        assert sorted(got[0]) == [-1, *range(STEPS)]
        for step, loss in want[0].items():
            assert got[0][step] == pytest.approx(loss, rel=1e-5), step
    assert set(got[1]) == set(want[1])
    for name, weight in want[1].items():
        scale = weight.abs().max().clamp(min=1e-12)
        assert (got[1][name] - weight).abs().max() <= 1e-5 * scale, name


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("context_parallel")


@pytest.fixture(scope="module")
def llama(shakespeare_llama3: Path) -> tuple[Path, list[str]]:
    data = [f"--data.init_args.data_dir={shakespeare_llama3}", "--data.init_args.seq_len=32"]
    return RECIPES / "llama3_debug_shakespeare_cpu.yaml", data


@pytest.fixture(scope="module")
def llama_single(work: Path, llama: tuple[Path, list[str]]):
    recipe, data = llama
    return _fit(work, recipe, "single2", [*data, "--data.init_args.batch_size=2"], 1, None)


LLAMA_LAYOUTS = {
    "cp4": (4, {"context_parallel": 4}),
    "cp2_tp2_sp_recompute": (
        4,
        {
            "context_parallel": 2,
            "tensor_parallel": 2,
            "sequence_parallel": True,
            "activation_checkpointing": "full",
        },
    ),
    "cp2_pp2": (4, {"context_parallel": 2, "pipeline_parallel": 2}),
    "cp2_pp2_gpipe": (4, {"context_parallel": 2, "pipeline_parallel": 2, "schedule": "gpipe"}),
    "cp2_pp2_interleaved": (
        4,
        {"context_parallel": 2, "pipeline_parallel": 2, "virtual_pipeline_parallel": 2},
    ),
    "cp2_fsdp2": (2, {"context_parallel": 2, "zero_stage": 3}),
}


@pytest.mark.parametrize("name", LLAMA_LAYOUTS)
def test_llama_layouts_train_the_one_process_run(
    name: str, work: Path, llama: tuple[Path, list[str]], llama_single
) -> None:
    recipe, data = llama
    ranks, options = LLAMA_LAYOUTS[name]
    layout = _strategy(work, name, **options)
    got = _fit(work, recipe, name, [*data, "--data.init_args.batch_size=2"], ranks, layout)
    _assert_same(got, llama_single)


def test_cp2_dp2_zero2_trains_the_one_process_run_of_the_global_batch(
    work: Path, llama: tuple[Path, list[str]]
) -> None:
    recipe, data = llama
    single = _fit(work, recipe, "single4", [*data, "--data.init_args.batch_size=4"], 1, None)
    layout = _strategy(work, "cp2_dp2", context_parallel=2, zero_stage=2)
    got = _fit(work, recipe, "cp2_dp2", [*data, "--data.init_args.batch_size=2"], 4, layout)
    _assert_same(got, single, losses=False)


def test_mla_and_moe_under_cp2_x_ep2(work: Path, shakespeare_gpt2: Path) -> None:
    recipe = RECIPES / "deepseek_v3_debug_shakespeare_cpu.yaml"
    data = [f"--data.init_args.data_dir={shakespeare_gpt2}", "--data.init_args.seq_len=32"]
    single = _fit(work, recipe, "moe4", [*data, "--data.init_args.batch_size=4"], 1, None)
    layout = _strategy(work, "cp2_ep2", context_parallel=2, expert_parallel=2)
    got = _fit(work, recipe, "cp2_ep2", [*data, "--data.init_args.batch_size=2"], 4, layout)
    _assert_same(got, single, losses=False)


def test_packed_masked_chat_rows_with_lora_and_accumulation(work: Path) -> None:
    root = work / "chat"
    root.mkdir()
    assert main(["prepare", "dates", "--count", "40", "--out", str(root / "dates.jsonl")]) == 0
    folder = root / "dates_chat"
    prepare = ["prepare", "chat", str(root / "dates.jsonl"), "--tokenizer", "gpt2"]
    prepare += ["--template", "plain", "--seq_len", "64", "--val_examples", "6"]
    assert main([*prepare, "--out", str(folder)]) == 0
    recipe = yaml.safe_load((RECIPES / "smollm2_lora_chat_cpu.yaml").read_text())
    (lora,) = [c for c in recipe["trainer"]["callbacks"] if c["class_path"].endswith(".LoRA")]
    lora["init_args"]["dropout"] = 0.0  # the same masks
    recipe_path = root / "chat.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    data = [
        "--model.init_args.weights=null",
        "--model.init_args.config=gpt2-debug",
        f"--data.init_args.data_dir={folder}",
        "--data.init_args.batch_size=2",
        "--trainer.accumulate_grad_batches=2",
    ]
    single = _fit(root, recipe_path, "single", data, 1, None)
    got = _fit(root, recipe_path, "cp2", data, 2, _strategy(root, "cp2", context_parallel=2))
    _assert_same(got, single)


@pytest.mark.parametrize(
    ("options", "seq_len", "expected"),
    [
        ({"context_parallel": 2}, 30, "seq_len=30 is not divisible by 2 x context_parallel=4"),
        ({"context_parallel": 3}, 32, "world_size=2 is not divisible by"),
    ],
)
def test_a_layout_that_cannot_run_is_one_line_before_launch(
    options: dict, seq_len: int, expected: str, tmp_path: Path, shakespeare_llama3: Path
) -> None:
    layout = _strategy(tmp_path, "bad", **options)
    proc = run_cli(
        "fit", "--config", str(RECIPES / "llama3_debug_shakespeare_cpu.yaml"),
        "--config", str(layout), f"--data.init_args.data_dir={shakespeare_llama3}",
        f"--data.init_args.seq_len={seq_len}", "--trainer.devices=2",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        cwd=REPO, exit_code=2, fresh_interpreter=False,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    assert expected in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()


def test_a_cp2_checkpoint_resumes_in_one_process(
    work: Path, llama: tuple[Path, list[str]], llama_single
) -> None:
    """cp2's step-2 checkpoint (weights and SGD state over dp x cp) resumed in one process
    ends at the uninterrupted one-process run's weights."""
    recipe, data = llama
    keep = ["--checkpoint.every_n_train_steps=2", "--checkpoint.save_top_k=-1"]
    layout = _strategy(work, "cp2_saved", context_parallel=2, zero_stage=1)
    batch = [*data, "--data.init_args.batch_size=2"]
    _fit(work, recipe, "cp2_saved", [*batch, *keep], 2, layout)
    (run,) = (work / "cp2_saved").iterdir()
    ckpt = run / "checkpoints" / "epoch=0-step=2.ckpt"
    resumed = _fit(work, recipe, "resumed", [*batch, f"--ckpt_path={ckpt}"], 1, None)
    _assert_same(resumed, llama_single, losses=False)
