"""End to end: every recipe parses, the CPU recipes train through the real CLI.

Commands are the expensive part, so each test exercises as much of one command as it can:
a fit checks the logs, the config and the checkpoint; the resume continues that fit;
generate reads that checkpoint. One-process commands run the CLI's entry point in a
process forked from the fork server (``run_cli(..., fresh_interpreter=False)``: the same
arguments, files, output and exit status without ~8 s of imports each); the DDP launch
(Lightning's launcher) and the console entry point's exit status start fresh interpreters.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from plugintrain.cli import PluginTrainCLI, main
from plugintrain.precision_plugins import BF16MixedPrecision, FP16MixedPrecision, FP32Precision

from _cli import RECIPES, REPO, cli_error, logged_losses, run_cli

ALL_RECIPES = sorted(RECIPES.glob("*.yaml"))
# Tiny overrides that keep every CPU fit to seconds while running the recipe's real path.
FAST = (
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=2",
    "--trainer.limit_val_batches=2",
    "--trainer.val_check_interval=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--checkpoint.every_n_train_steps=2",
    "--throughput.window_size=2",
)


def test_recipes_cover_the_issue() -> None:
    names = {p.stem for p in ALL_RECIPES}
    assert {
        "mnist",
        "gpt2_124m_shakespeare",
        "llama3_1b_shakespeare",
        "gpt2_debug_shakespeare_cpu",
        "llama3_debug_shakespeare_cpu",
        "smollm2_lora_shakespeare_cpu",
        "llama3_1b_lora_shakespeare",
        "qwen3_debug_shakespeare_cpu",
        "qwen3_0.6b_shakespeare",
        "deepseek_v3_debug_shakespeare_cpu",
        "moe_1b_shakespeare",
    } <= names


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        PluginTrainCLI(args=["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: plugintrain." in printed
    assert "save_last: true" in printed  # the default checkpoint callback is configured


def test_overview_lists_tools(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "prepare", "generate"):
        assert command in out


def test_data_too_long_for_model_fails_before_training(shakespeare_gpt2: Path) -> None:
    recipe = RECIPES / "gpt2_debug_shakespeare_cpu.yaml"
    with pytest.raises(ValueError, match=r"seq_len=4096 exceeds the model's max_seq_len=256"):
        PluginTrainCLI(
            args=[
                "--config", str(recipe),
                f"--data.init_args.data_dir={shakespeare_gpt2}",
                "--data.init_args.seq_len=4096",
            ],
            run=False,
        )  # fmt: skip


def test_hybrid_layout_that_cannot_split_the_model_fails_before_launch(
    shakespeare_gpt2: Path,
) -> None:
    # GPT-2's 50,257-token vocabulary cannot be split over tp=2: refused at parse time,
    # before the strategy would start its 4 processes.
    with pytest.raises(ValueError, match=r"'vocab_size': 50257.*tensor_parallel=2"):
        PluginTrainCLI(
            args=[
                "--config", str(RECIPES / "llama3_debug_hybrid_cpu.yaml"),
                "--model.init_args.config=gpt2-debug",
                f"--data.init_args.data_dir={shakespeare_gpt2}",
            ],
            run=False,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("precision", "plugin", "dtype"),
    [
        ("16-mixed", FP16MixedPrecision, torch.float16),  # Lightning's own would pick bf16 on CPU
        ("bf16-mixed", BF16MixedPrecision, torch.bfloat16),
        ("32-true", FP32Precision, torch.float32),
    ],
)
def test_precision_names_select_our_plugins(
    shakespeare_gpt2: Path, precision: str, plugin: type, dtype: torch.dtype
) -> None:
    cli = PluginTrainCLI(
        args=[
            "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
            f"--data.init_args.data_dir={shakespeare_gpt2}",
            f"--trainer.precision={precision}",
        ],
        run=False,
    )  # fmt: skip
    assert type(cli.trainer.precision_plugin) is plugin
    if dtype is not torch.float32:
        assert cli.trainer.precision_plugin.autocast_context_manager().fast_dtype == dtype


def test_precision_set_twice_is_refused(shakespeare_gpt2: Path) -> None:
    with pytest.raises(ValueError, match="both set the precision"):
        PluginTrainCLI(
            args=[
                "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
                f"--data.init_args.data_dir={shakespeare_gpt2}",
                "--trainer.precision=bf16-mixed",
                "--trainer.plugins+=plugintrain.precision_plugins.FP16MixedPrecision",
            ],
            run=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def gpt2_run(shakespeare_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step fit of the GPT-2 CPU recipe; returns its log version directory."""
    return _fit_gpt2(shakespeare_gpt2, tmp_path_factory.mktemp("runs"), 4)


def test_fit_writes_logs_config_and_checkpoints(gpt2_run: Path) -> None:
    assert (gpt2_run / "config.yaml").is_file()
    losses = logged_losses(gpt2_run, "train_loss")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert logged_losses(gpt2_run, "val_loss")
    assert logged_losses(gpt2_run, "throughput/device/tokens_per_sec")  # throughput monitor
    assert logged_losses(gpt2_run, "lr/pg1")
    ckpt = torch.load(gpt2_run.parent / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4


def _fit_gpt2(data_dir: Path, save_dir: Path, max_steps: int, *extra: str) -> Path:
    run_cli(
        "fit", "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
        f"--data.init_args.data_dir={data_dir}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        f"--trainer.max_steps={max_steps}", "--model.init_args.lr_decay_steps=6",
        *FAST, *extra,
        cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    return save_dir / "gpt2_debug_shakespeare_cpu" / "version_0"


def test_resume_from_last_equals_an_uninterrupted_run(
    gpt2_run: Path, shakespeare_gpt2: Path, tmp_path: Path
) -> None:
    # `last` finds the 4-step run's last.ckpt in the recipe's checkpoint directory.
    run_dir = gpt2_run.parent
    _fit_gpt2(shakespeare_gpt2, run_dir.parent, 6, "--ckpt_path=last")
    resumed = run_dir / "version_1"
    uninterrupted = _fit_gpt2(shakespeare_gpt2, tmp_path / "uninterrupted", 6)
    # Same weights, optimizer state, LR schedule and data position: the same losses.
    after_resume = logged_losses(resumed, "train_loss")
    assert sorted(after_resume) == [4, 5]
    expected = logged_losses(uninterrupted, "train_loss")
    assert after_resume == pytest.approx({s: expected[s] for s in (4, 5)}, rel=1e-6)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6


def test_generate_from_checkpoint(gpt2_run: Path) -> None:
    proc = run_cli(
        "generate", f"--ckpt_path={gpt2_run.parent / 'checkpoints' / 'last.ckpt'}",
        "--prompt=ROMEO:", "--max_new_tokens=8", "--temperature=0", "--json",
        cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    sample = json.loads(proc.stdout)
    prompt = [33676, 4720, 25]  # "ROMEO:" in GPT-2 BPE
    assert sample["tokens"][:3] == prompt and len(sample["tokens"]) == 3 + 8
    assert sample["text"].startswith("ROMEO:")


@pytest.mark.parametrize(
    ("recipe", "tokens"),
    [
        ("llama3_debug_shakespeare_cpu", "shakespeare_llama3"),
        ("qwen3_debug_shakespeare_cpu", "shakespeare_gpt2"),  # selective recomputation
    ],
)
def test_debug_recipe_fits(
    recipe: str, tokens: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run_cli(
        "fit", "--config", str(RECIPES / f"{recipe}.yaml"),
        f"--data.init_args.data_dir={request.getfixturevalue(tokens)}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_steps=2", *FAST,
        cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    losses = logged_losses(tmp_path / recipe / "version_0", "train_loss")
    assert len(losses) == 2


def test_ddp_two_processes_from_the_same_recipe(shakespeare_gpt2: Path, tmp_path: Path) -> None:
    run_cli(
        "fit", "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
        f"--data.init_args.data_dir={shakespeare_gpt2}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.strategy=ddp", "--trainer.devices=2",
        "--trainer.max_steps=2", *FAST,
        cwd=REPO,
    )  # fmt: skip
    run = tmp_path / "gpt2_debug_shakespeare_cpu" / "version_0"
    assert len(logged_losses(run, "train_loss")) == 2
    ckpt = torch.load(run.parent / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    # The saved position counts the samples of both ranks (steps x per-rank batch x 2), so
    # a resume under any dp size continues where this run stopped.
    assert ckpt["TokenDataModule"]["position"] == 2 * 2 * 2


def test_forked_ranks_fail_with_the_first_failure_and_every_rank_s_output(tmp_path: Path) -> None:
    """The test runner's torchrun-like launch (``run_cli(..., ranks=2)``, what the
    multi-process fits of other files use): both ranks refuse a mistyped option, the
    command exits 2 with each rank's output, rank 0's last, and wrote nothing."""
    proc = run_cli(
        "fit", "--config", str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml"),
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", "--trainer.max_step=5",
        cwd=tmp_path, fresh_interpreter=False, ranks=2, exit_code=2,
    )  # fmt: skip
    sections = proc.stderr.split("[rank ")
    assert [section[:2] for section in sections[1:]] == ["1 ", "0 "]
    for section in sections[1:]:
        assert "max_step" in section.strip().splitlines()[-1], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_mnist_recipe_fits(mnist_dir: Path, tmp_path: Path) -> None:
    run_cli(
        "fit", "--config", str(RECIPES / "mnist.yaml"),
        f"--data.init_args.data_dir={mnist_dir}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
        cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    val_acc = logged_losses(tmp_path / "mnist" / "version_0", "val_acc")
    assert max(val_acc.values()) > 0.8  # real digits, one epoch of a small MLP


def test_prepare_reports_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "mnist"
    proc = run_cli("prepare", "mnist", f"--out={out}", cwd=REPO, fresh_interpreter=False)
    summary = json.loads(proc.stdout)
    assert summary["train_images"] == 4500
    assert (out / "train-images-idx3-ubyte").is_file()


def test_user_errors_end_the_real_command_in_one_line(tmp_path: Path) -> None:
    # Through the console entry point (one subprocess: ~10 s of imports): exit status 2,
    # the message last, no traceback and no usage (cli_error checks), nothing written.
    recipe = str(RECIPES / "gpt2_debug_shakespeare_cpu.yaml")
    runs = f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"
    line = cli_error(
        "fit", "--config", recipe, runs, f"--data.init_args.data_dir={tmp_path}",
        "--data.init_args.seq_len=512", cwd=REPO,
    )  # fmt: skip
    assert line == "plugintrain fit: error: seq_len=512 exceeds the model's max_seq_len=256"
    assert not (tmp_path / "runs").exists()
    # The other bad inputs go through `main` in-process: tests/unit/test_cli_errors.py,
    # test_generate.py and test_compare.py.


def test_llama_recipe_on_gpt2_tokens_names_the_prepare_command_that_fixes_it(
    shakespeare_gpt2: Path, shakespeare_llama3: Path, tmp_path: Path, capfd
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shakespeare_gpt2").symlink_to(shakespeare_gpt2)
    # What the hinted command writes, already written (by the session fixture): running
    # it is then quick, and must leave files the Llama recipe accepts.
    (data / "shakespeare_llama3").symlink_to(shakespeare_llama3)
    recipe = str(RECIPES / "llama3_debug_shakespeare_cpu.yaml")
    fit = ["fit", "--config", recipe, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    assert main([*fit, f"--data.init_args.data_dir={data / 'shakespeare_gpt2'}"]) == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(
        f"plugintrain fit: error: {data / 'shakespeare_gpt2'} holds gpt2 tokens (its"
        " meta.json) but the model reads llama3 tokens; prepare them with `plugintrain"
        f" prepare shakespeare --tokenizer llama3 --out {data / 'shakespeare_llama3'}`"
    )
    prepare, data_dir = (shlex.split(part) for part in line.split("`")[1::2])
    assert main(prepare[1:]) == 0
    cli = PluginTrainCLI(args=[*fit[1:], *data_dir], run=False)
    assert cli.datamodule.tokenizer == "llama3"
    assert cli.datamodule.data_dir == data / "shakespeare_llama3"


def test_generate_beyond_the_context_names_the_options_that_fit(gpt2_run: Path, capsys) -> None:
    ckpt = f"--ckpt_path={gpt2_run.parent / 'checkpoints' / 'last.ckpt'}"
    prompt = "ROMEO: " * 83  # 250 GPT-2 tokens of the model's 256
    args = ["generate", ckpt, f"--prompt={prompt}", "--temperature=0", "--json"]
    assert main([*args, "--max_new_tokens=10"]) == 2
    assert capsys.readouterr().err == (
        "plugintrain generate: error: the prompt's 250 tokens + --max_new_tokens 10 = 260"
        " exceed the model's block_size=256; pass --max_new_tokens 6, or --no_cache to"
        " crop the context to the last 256 tokens\n"
    )
    assert main([*args, "--max_new_tokens", "6"]) == 0  # either fix, as given, works
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 256
    assert main([*args, "--max_new_tokens=10", "--no_cache"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 260
