"""Every command of the registry: ``--help``, a misspelt option, ``--print_config`` and
``--config FILE``, in this process (nothing heavy runs: each stops at its parser).

Each command is listed in :data:`MINIMAL` with the fewest words that parse; a command
registered without a row fails :func:`test_every_command_has_a_row`, so a new command gets
these checks too. Whether ``--help`` and a typo import torch is checked in a fresh
interpreter in ``test_startup.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugintrain.cli import main
from plugintrain.tools import COMMANDS
from plugintrain.tools._command import Group, build_parser

MINIMAL: dict[str, list[str]] = {
    "recipes": [],
    "prepare shakespeare": [],
    "prepare mnist": [],
    "prepare text": ["a.txt", "--tokenizer", "gpt2", "--out", "out"],
    "prepare chat": ["a.jsonl", "--tokenizer", "gpt2", "--out", "out"],
    "prepare preference": ["a.jsonl", "--tokenizer", "gpt2", "--out", "out"],
    "prepare dates": [],
    "prepare merge": ["task0", "task1", "--out", "out"],
    "generate": ["--weights", "last.ckpt"],
    "chat": ["--weights", "last.ckpt"],
    "evaluate": ["--weights", "last.ckpt", "--data", "data/x"],
    "export": ["last.ckpt", "out", "--format", "hf"],
    "convert": ["model.gguf", "out", "--format", "hf"],
    "compare": ["run_a", "run_b"],
    "schedule": ["--pp", "2", "--microbatches", "4"],
    "estimate": ["gpt2-debug", "--dp", "2"],
    "bench": ["--matrix", "benchmarks/cpu.yaml"],
    "gpu-check": [],
}
"""The fewest words each command (each of a group's) parses, options included."""
PASSED_THROUGH = {"lm-eval"}
"""Commands whose words go to another program's parser (lm-evaluation-harness's own)."""


def _functions() -> dict[str, object]:
    """Every command's function by its full name (``prepare text``, ...)."""
    found = {}
    for name, spec in COMMANDS.items():
        if spec.passthrough:
            continue
        command = spec.load()
        if isinstance(command, Group):
            found |= {f"{name} {sub}": f for sub, f in command.commands.items()}
        else:
            found[name] = command
    return found


FUNCTIONS = _functions()


def _main(capsys, words: list[str]) -> tuple[int, str, str]:
    code = main(words)
    out, err = capsys.readouterr()
    return code, out, err


def test_every_command_has_a_row() -> None:
    assert set(MINIMAL) == set(FUNCTIONS)
    assert {n for n, s in COMMANDS.items() if s.passthrough} == PASSED_THROUGH


@pytest.mark.parametrize("name", sorted({*COMMANDS, *FUNCTIONS}))
def test_help_exits_0(capsys, name: str) -> None:
    if name in PASSED_THROUGH:
        pytest.importorskip("lm_eval")
    code, out, _ = _main(capsys, [*name.split(), "--help"])
    assert code == 0
    assert out.startswith("usage: ") or "usage:" in out


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_misspelt_option_is_one_line_with_a_suggestion(capsys, name: str) -> None:
    parser = build_parser(FUNCTIONS[name], f"plugintrain {name}")
    options = [o for a in parser._actions for o in a.option_strings[:1] if o.startswith("--")]
    own = [o for o in options if o not in ("--help", "--config", "--print_config")]
    option = max(own, key=len, default="--print_config")  # recipes: an option of all
    typo = option[:-1]  # also an abbreviation, which is never taken
    code, out, err = _main(capsys, [*name.split(), *MINIMAL[name], typo])
    assert code == 2 and out == ""
    assert err == (
        f"plugintrain {name}: error: unknown option {typo}; did you mean {option}? (options"
        " are never abbreviated; --help lists them)\n"
    )


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_print_config_prints_the_yaml_that_config_reads_back(capsys, tmp_path, name) -> None:
    code, printed, err = _main(capsys, [*name.split(), *MINIMAL[name], "--print_config"])
    assert (code, err) == (0, "")
    import yaml

    resolved = yaml.safe_load(printed)
    assert isinstance(resolved, dict) and "config" not in resolved
    config = tmp_path / "options.yaml"
    config.write_text(printed)
    code, again, err = _main(capsys, [*name.split(), "--config", str(config), "--print_config"])
    assert (code, err) == (0, "")
    assert yaml.safe_load(again) == resolved


def test_a_config_file_runs_as_its_flags_do(capsys, tmp_path: Path) -> None:
    flags = ["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--forward-only"]
    code, by_flags, _ = _main(capsys, flags)
    assert code == 0 and " F0 " in by_flags and " B0 " not in by_flags  # forwards alone
    config = tmp_path / "schedule.yaml"
    config.write_text("pp: 4\nvpp: 2\nmicrobatches: 8\nforward_only: true\n")
    code, by_config, _ = _main(capsys, ["schedule", "--config", str(config)])
    assert code == 0 and by_config == by_flags
    # A flag after --config overrides the file, as in `fit`.
    code, overridden, _ = _main(capsys, ["schedule", "--config", str(config), "--pp", "2"])
    code, two, _ = _main(capsys, ["schedule", "--pp", "2", *flags[3:]])
    assert overridden == two != by_flags


def test_a_misspelt_key_of_a_config_file_is_one_line(capsys, tmp_path: Path) -> None:
    config = tmp_path / "schedule.yaml"
    config.write_text("pp: 2\nmicrobatchs: 4\n")
    code, _, err = _main(capsys, ["schedule", "--config", str(config)])
    assert code == 2
    assert err == (
        "plugintrain schedule: error: unknown option --microbatchs; did you mean"
        " --microbatches? (options are never abbreviated; --help lists them)\n"
    )


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["schedule", "--pp", "x", "--microbatches", "4"], "--pp x: expected an int"),
        (["schedule", "--pp", "2"], "the following arguments are required: --microbatches"),
        (
            ["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "1f2b"],
            "--schedule 1f2b: choose from gpipe, 1f1b, interleaved",
        ),
        (["prepare", "txt"], "unknown prepare command 'txt'; did you mean text?"),
        (["recipes", "a", "b"], "unexpected argument 'b'"),
    ],
)
def test_parse_errors_are_one_line(capsys, words: list[str], message: str) -> None:
    code, out, err = _main(capsys, words)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert message in err and err.startswith("plugintrain ")


def test_the_overview_lists_every_command_with_its_summary(capsys) -> None:
    code, out, _ = _main(capsys, ["--help"])
    assert code == 0
    rows = [line for line in out.splitlines() if line[:2] == "  " and line[2] != " "]
    listed = [row.split()[0] for row in rows]
    assert listed == ["fit", "validate", "test", "predict", *COMMANDS]
