"""User errors of ``plugintrain fit``: one line, the last printed, exit status 2, nothing run.

Each case calls ``plugintrain.cli.main`` in-process on the GPT-2 CPU recipe with a bad
value and tiny token files; every error is raised while the command is parsed or its
classes are built, so nothing trains and nothing is written. The subprocess runs that
check the same through the console entry point are in ``tests/e2e/test_cli.py``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch.callbacks.model_summary as lightning_summary
import numpy as np
import pytest

from plugintrain.callbacks import CountedFlopsSummary, StepProgressBar, display
from plugintrain.cli import PluginTrainCLI, main
from plugintrain.cli_messages import ConfigError, user_message
from plugintrain.data import write_token_bin
from plugintrain.strategies import STRATEGY_NAMES
from plugintrain.tools._command import parse
from plugintrain.tools.prepare import PREPARE

REPO = Path(__file__).resolve().parents[2]
GPT2_RECIPE = REPO / "recipes" / "gpt2_debug_shakespeare_cpu.yaml"


def _prepare_args(words: list[str]) -> SimpleNamespace:
    """What ``plugintrain prepare WORDS`` parses to (nothing runs): its dataset and options."""
    options = parse(PREPARE.commands[words[0]], words[1:], f"plugintrain prepare {words[0]}")
    return SimpleNamespace(dataset=words[0], **options)


def _token_dir(path: Path, tokenizer: str = "gpt2", vocab_size: int = 50257) -> Path:
    """Token files as ``plugintrain prepare`` leaves them (tiny), with their meta.json."""
    write_token_bin(path / "train.bin", np.arange(300) % 1000)
    write_token_bin(path / "val.bin", np.arange(300) % 1000)
    meta = {"dataset": "shakespeare", "tokenizer": tokenizer, "vocab_size": vocab_size}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture
def gpt2_tokens(tmp_path: Path) -> Path:
    return _token_dir(tmp_path / "shakespeare_gpt2")


def _fit_error(capfd, tmp_path: Path, data_dir: Path, *overrides: str) -> str:
    """Run ``plugintrain fit`` on the GPT-2 recipe; it must exit 2 having written nothing.
    Returns the last line of stderr."""
    runs = tmp_path / "runs"
    code = main(
        [
            "fit", "--config", str(GPT2_RECIPE),
            f"--data.init_args.data_dir={data_dir}",
            f"--trainer.logger.init_args.save_dir={runs}",
            *overrides,
        ]
    )  # fmt: skip
    assert code == 2
    assert not runs.exists()  # no log, config or checkpoint written
    err = capfd.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--data.init_args.seq_len=512", "seq_len=512 exceeds the model's max_seq_len=256"),
        ("--data.init_args.batch_size=0", "seq_len (128) and batch_size (0) must be >= 1"),
        (
            "--model.init_args.config=gpt2-debugg",
            "Unknown model preset 'gpt2-debugg'; known presets: ['deepseek-v3',"
            " 'deepseek-v3-debug', 'gpt2-1.5b', 'gpt2-124m', 'gpt2-350m', 'gpt2-774m',"
            " 'gpt2-debug', 'llama3-debug', 'llama3.1-405b', 'llama3.1-70b', 'llama3.1-8b',"
            " 'llama3.2-1b', 'llama3.2-3b',"
            " 'moe-1b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-30b-a3b', 'qwen3-8b', 'qwen3-debug',"
            " 'qwen3-moe-debug'].",
        ),
        (
            "--trainer.max_step=3",  # an abbreviation of max_steps: refused, not expanded
            "unknown option --trainer.max_step; did you mean --trainer.max_steps? (options"
            " are never abbreviated; --help lists them)",
        ),
        (
            "--trainer.max_steps=abc",
            "--trainer.max_steps: Expected a <class 'int'>. Got value: abc",
        ),
        (
            "--trainer.strategy=zero3",
            "unknown strategy 'zero3'; did you mean 'zero2' or 'zero1'? plugintrain's:"
            " ddp_bucketed, zero1, zero2, parameter_server, hybrid, pipeline; Lightning's:"
            " auto, ddp, ddp_spawn,",
        ),
        (
            "--trainer.precision=bf17",
            "unknown precision 'bf17'; did you mean 'bf16'? plugintrain's: 32-true,"
            " bf16-true, bf16-mixed, 16-mixed; Lightning's: 64, 32, 16,",
        ),
        ("--config=missing.yaml", "--config: File does not exist:"),
    ],
    ids=["seq_len", "batch_size", "preset", "abbreviation", "type", "strategy", "precision",
         "config"],
)  # fmt: skip
def test_bad_value_is_one_line_naming_the_fix(
    capfd, tmp_path: Path, gpt2_tokens: Path, override: str, message: str
) -> None:
    line = _fit_error(capfd, tmp_path, gpt2_tokens, override)
    assert line.startswith(f"plugintrain fit: error: {message}")


def test_token_files_of_another_tokenizer_name_a_prepare_command_that_fits(
    capfd, tmp_path: Path, gpt2_tokens: Path
) -> None:
    # The Llama recipe's model on GPT-2 token files.
    line = _fit_error(capfd, tmp_path, gpt2_tokens, "--model.init_args.config=llama3-debug")
    out = tmp_path / "shakespeare_llama3"
    assert line == (
        f"plugintrain fit: error: {gpt2_tokens} holds gpt2 tokens (its meta.json) but the model"
        f" reads llama3 tokens; prepare them with `plugintrain prepare shakespeare"
        f" --tokenizer llama3 --out {out}` and pass `--data.init_args.data_dir {out}`"
    )
    args = _prepare_args(_hinted_command(line)[2:])
    assert (args.dataset, args.tokenizer, args.out, args.overwrite) == (
        "shakespeare", "llama3", str(out), False,
    )  # fmt: skip
    # What that command writes is accepted: here, token files whose meta.json says so.
    _token_dir(out, tokenizer="llama3", vocab_size=128256)
    cli = PluginTrainCLI(
        args=[
            "--config", str(GPT2_RECIPE), "--model.init_args.config=llama3-debug",
            f"--data.init_args.data_dir={out}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ],
        run=False,
    )  # fmt: skip
    assert cli.datamodule.tokenizer == "llama3"


def test_a_dir_named_for_the_model_but_holding_other_tokens_is_overwritten(
    capfd, tmp_path: Path
) -> None:
    wrong = _token_dir(tmp_path / "shakespeare_llama3", tokenizer="gpt2")
    line = _fit_error(capfd, tmp_path, wrong, "--model.init_args.config=llama3-debug")
    args = _prepare_args(_hinted_command(line)[2:])
    assert (args.tokenizer, args.out, args.overwrite) == ("llama3", str(wrong), True)


def test_missing_token_files_name_the_model_s_tokenizer(capfd, tmp_path: Path) -> None:
    missing = tmp_path / "no data here"
    line = _fit_error(capfd, tmp_path, missing, "--model.init_args.config=llama3-debug")
    assert line == (
        f"plugintrain fit: error: token file {missing / 'train.bin'} not found; create it with"
        f" `plugintrain prepare shakespeare --tokenizer llama3 --out '{missing}'`"
    )
    args = _prepare_args(_hinted_command(line)[2:])
    assert (args.tokenizer, args.out) == ("llama3", str(missing))


def test_no_recipe(capfd) -> None:
    assert main(["fit"]) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "plugintrain fit: error: the following arguments are required: fit.model; a recipe"
        " sets them: --config recipes/<recipe>.yaml"
    )


def test_unknown_command(capfd) -> None:
    assert main(["fitt", "--config", str(GPT2_RECIPE)]) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "plugintrain fitt: error: unknown command 'fitt'; did you mean fit?"
        " (`plugintrain --help` lists the commands)"
    )


def test_fit_help_lists_plugintrain_s_strategies_and_precisions(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    strategy = text[text.index("--trainer.strategy STRATEGY A name: plugintrain's") :]
    for name in STRATEGY_NAMES:
        assert f"{name} (" in strategy[:1000]
    assert (
        "--trainer.precision PRECISION plugintrain's precision plugins: 32-true, bf16-true,"
        " bf16-mixed, 16-mixed" in text
    )


def _hinted_command(line: str) -> list[str]:
    """The ``plugintrain prepare ...`` command quoted in an error line, as argv."""
    start = line.index("`plugintrain prepare") + 1
    return shlex.split(line[start : line.index("`", start)])


def test_bugs_keep_their_traceback() -> None:
    # A user's mistake is a ValueError (or jsonargparse's own check); anything else is a
    # bug and is re-raised as it is.
    assert user_message(ValueError("seq_len=9 exceeds")) == "seq_len=9 exceeds"
    assert user_message(AttributeError("'NoneType' object has no attribute 'x'")) is None
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("Does not validate against any of the Union subtypes") from None
    except ValueError as wrapped:
        assert user_message(wrapped) == "Does not validate against any of the Union subtypes"
    assert issubclass(ConfigError, ValueError)  # `run=False` callers catch ValueError


def test_progress_bar_shows_no_last_epoch_when_only_steps_bound_the_run() -> None:
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # max_steps set, max_epochs left unset
    assert bar._get_train_description(0).strip() == "Epoch 0"
    bar._trainer = SimpleNamespace(max_epochs=3)
    assert bar._get_train_description(1).strip() == "Epoch 1/2"


def test_model_summary_prints_flops_only_when_counted(monkeypatch) -> None:
    lines: list[str] = []
    for module in (display, lightning_summary):  # ours, and Lightning's when FLOPs were counted
        monkeypatch.setattr(module, "log", SimpleNamespace(info=lines.append))
    columns = [
        (" ", ["0"]), ("Name", ["model"]), ("Type", ["Transformer"]), ("Params", ["7.3 M"]),
        ("Mode", ["train"]), ("FLOPs", ["0"]),
    ]  # fmt: skip
    modes = {"train": 1, "eval": 0}
    CountedFlopsSummary.summarize(columns, 7_300_000, 7_300_000, 29.0, modes, total_flops=0)
    assert "Total params" in lines[-1] and "FLOPs" not in lines[-1] and "Flops" not in lines[-1]
    columns[-1] = ("FLOPs", ["1.2 M"])
    CountedFlopsSummary.summarize(columns, 7_300_000, 7_300_000, 29.0, modes, 1_200_000)
    assert "FLOPs" in lines[-1] and "1.2 M" in lines[-1]


def test_a_model_reads_the_tokenizer_its_config_names(capfd, tmp_path: Path, gpt2_tokens: Path):
    # A config that names the tokenizer its weights came with: the data must be its tokens.
    fields = {
        "name": "smollm2-like", "family": "llama3", "vocab_size": 49152, "block_size": 256,
        "n_layer": 1, "n_head": 4, "n_embd": 64, "n_kv_head": 2, "norm": "rmsnorm",
        "mlp": "swiglu", "position": "rope", "bias": False, "tokenizer": "smollm2-135m",
    }  # fmt: skip
    line = _fit_error(
        capfd, tmp_path, gpt2_tokens, f"--model.init_args.config={json.dumps(fields)}"
    )
    out = tmp_path / "shakespeare_smollm2-135m"
    assert line == (
        f"plugintrain fit: error: {gpt2_tokens} holds gpt2 tokens (its meta.json) but the model"
        f" reads smollm2-135m tokens; prepare them with `plugintrain prepare shakespeare"
        f" --tokenizer smollm2-135m --out {out}` and pass `--data.init_args.data_dir {out}`"
    )


@pytest.mark.parametrize(
    ("class_path", "expected"),
    [
        ("plugintrain.strategies.ZeroStrategy", "ZeroStrategy"),
        ("plugintrain.strategies.HybridParallelStrategy", "HybridParallelStrategy"),
    ],
)
def test_a_strategy_s_class_path_alone_takes_its_defaults(tmp_path, class_path, expected):
    """``--trainer.strategy=<class path>`` without init_args, as LightningCLI users write it."""
    cli = _built_with_strategy(tmp_path, class_path)
    assert type(cli.trainer.strategy).__name__ == expected
    if expected == "ZeroStrategy":
        assert cli.trainer.strategy.engine_stage == 2  # the class default


def test_a_class_path_that_is_no_strategy_is_an_unknown_strategy(tmp_path):
    with pytest.raises(Exception, match=r"unknown strategy 'plugintrain\.data\.TokenDataModule'"):
        _built_with_strategy(tmp_path, "plugintrain.data.TokenDataModule")


def _built_with_strategy(tmp_path: Path, strategy: str) -> PluginTrainCLI:
    """The GPT-2 recipe built (not run) on tiny token files with ``--trainer.strategy``."""
    return PluginTrainCLI(
        args=[
            "--config", str(GPT2_RECIPE), f"--trainer.strategy={strategy}",
            f"--data.init_args.data_dir={_token_dir(tmp_path)}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ],
        run=False,
    )  # fmt: skip
