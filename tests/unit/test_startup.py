"""Commands that train nothing start without Lightning; ``fit`` reports a mistyped Trainer
option before importing it.

Each command whose imports are checked runs in a fresh interpreter (what a user's shell
starts), which then lists the heavy packages it imported; the training commands' ``--help``,
which imports everything, runs four to an interpreter. How long each takes is measured in
``benchmarks/startup.py``, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plugintrain.cli import TRAINING_COMMANDS
from plugintrain.lightning_options import trainer_options
from plugintrain.tools import COMMANDS

REPO = Path(__file__).resolve().parents[2]
_PROBE = """
import contextlib, io, json, sys
from plugintrain.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    heavy = [m for m in ("lightning", "torchmetrics", "torch") if m in sys.modules]
    results.append({"code": code, "heavy": heavy, "err": err.getvalue()})
print(json.dumps(results))
"""


def _run_each(*argvs: list[str]) -> list[dict]:
    """Each command in turn in one fresh interpreter: its exit status, its stderr and the
    heavy packages imported so far (by it and the ones before)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argvs)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(*argv: str) -> dict:
    return _run_each(list(argv))[0]


# lm-eval passes its words to lm-evaluation-harness, which imports torch to list its options.
LIGHT_COMMANDS = [name for name, spec in COMMANDS.items() if not spec.passthrough]


@pytest.mark.parametrize("command", LIGHT_COMMANDS)
def test_help_and_a_typo_import_neither_lightning_nor_torch(command: str) -> None:
    """``--help``, then a misspelt option refused in one line, in one fresh interpreter."""
    words = [command, "text"] if command == "prepare" else [command]
    helped, refused = _run_each([command, "--help"], [*words, "--no_such_option"])
    assert helped["code"] == 0 and helped["heavy"] == [], helped
    assert refused["code"] == 2 and refused["heavy"] == [], refused
    assert refused["err"].count("\n") == 1 and "unknown option --no_such_option" in refused["err"]


def test_help_of_the_training_commands_exits_0() -> None:
    """LightningCLI builds their help, so they import everything: checked only to exit 0,
    all four in one interpreter (the imports are paid once)."""
    results = _run_each(*([command, "--help"] for command in TRAINING_COMMANDS))
    assert [result["code"] for result in results] == [0] * len(TRAINING_COMMANDS), results


@pytest.mark.parametrize(
    ("argv", "heavy"),
    [
        (["schedule", "--pp", "2", "--microbatches", "4"], []),
        (["estimate", "gpt2-debug", "--dp", "2", "--zero_stage", "2"], ["torch"]),
        (["recipes", "gpt2_debug_shakespeare_cpu"], []),
        (["prepare", "shakespeare", "--tokenizer", "gtp2"], []),  # a one-line error
        (["generate", "--ckpt_path", "missing.ckpt"], []),  # refused before loading
        (["chat", "--weights", "missing.ckpt"], []),
        (["evaluate", "--weights", "missing.ckpt", "--data", "data/missing"], []),
        (["evaluate", "--weights", "smollm2-135m", "--data", "data/missing"], ["torch"]),
    ],
)
def test_commands_that_train_nothing_run_without_lightning(argv: list[str], heavy: list) -> None:
    assert _run(*argv)["heavy"] == heavy


def test_a_mistyped_trainer_option_is_refused_before_lightning_loads() -> None:
    result = _run("fit", "--config", "gpt2_debug_shakespeare_cpu", "--trainer.max_step", "5")
    assert result["code"] == 2 and result["heavy"] == []
    assert result["err"].strip().splitlines()[-1] == (
        "plugintrain fit: error: unknown option --trainer.max_step; did you mean"
        " --trainer.max_steps? (options are never abbreviated; --help lists them)"
    )


def test_trainer_options_read_from_source_are_the_trainers_parameters() -> None:
    """The early check reads ``Trainer.__init__`` from Lightning's source; torch's
    ``inspect`` of the imported class is the reference."""
    import inspect

    from lightning.pytorch import Trainer

    expected = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    assert trainer_options() == expected


def test_training_commands_are_lightning_clis() -> None:
    from plugintrain.lightning_cli import PluginTrainCLI

    assert tuple(PluginTrainCLI.subcommands()) == TRAINING_COMMANDS


def test_strategy_names_are_the_registered_ones() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from plugintrain import strategies

    strategies.register()
    ours = {
        n for n, e in StrategyRegistry.items() if e["strategy"].__module__.startswith("plugintrain")
    }
    assert ours == set(strategies.STRATEGY_NAMES)


_FACE_PROBE = """
import importlib, pkgutil, sys
wrong = []
for name in sys.argv[1:]:
    face = importlib.import_module(name)
    for info in pkgutil.iter_modules(face.__path__):  # as a long run ends up doing
        importlib.import_module(f"{name}.{info.name}")
    for attr in face.__all__:
        try:
            meant = face.__getattr__(attr)
        except AttributeError:  # defined in the face itself
            continue
        if getattr(face, attr) is not meant:
            wrong.append(f"{name}.{attr} is {getattr(face, attr)!r}, not {meant!r}")
print("\\n".join(wrong))
"""
LAZY_FACES = (
    "plugintrain.data",
    "plugintrain.model_zoo",
    "plugintrain.strategies",
    "plugintrain.estimate",
    "plugintrain.bench",
)


def test_a_lazy_name_means_the_same_after_every_submodule_is_imported() -> None:
    """Importing a submodule sets it as an attribute of its package, and a package attribute
    wins over the face's ``__getattr__``: a function named like its own module (this was
    ``strategies.parallelize``) turned into that module once anything imported it."""
    out = subprocess.run(
        [sys.executable, "-c", _FACE_PROBE, *LAZY_FACES],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert out.stdout.strip() == ""
