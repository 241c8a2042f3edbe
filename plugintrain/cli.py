"""The ``plugintrain`` command line: one entry point, :func:`main`, that imports nothing heavy
until it knows what runs.

``plugintrain prepare|generate|convert|...`` are typed functions registered in
:data:`plugintrain.tools.COMMANDS`, that need no Trainer and load torch only once their
arguments are checked;
``plugintrain fit|validate|test|predict`` run through
:class:`~plugintrain.lightning_cli.PluginTrainCLI`, imported (with Lightning) only after the
command, the ``--config`` recipe and the ``--trainer.*`` option names have been checked.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from typing import Any

from plugintrain.cli_messages import ConfigError, unknown_option
from plugintrain.lightning_options import trainer_options

TRAINING_COMMANDS = ("fit", "validate", "test", "predict")
"""LightningCLI's subcommands (``PluginTrainCLI.subcommands()``, without importing it)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plugintrain`` console script and ``python -m plugintrain``."""
    from plugintrain.tools import COMMANDS, overview, run_command

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(overview(), end="")
        return 0
    if args[0] in COMMANDS:
        return run_command(args[0], args[1:])
    try:
        args = checked_training_args(args)
        if argv is None:  # LightningCLI reads sys.argv itself; passing it again only warns
            sys.argv[1:] = args
        from plugintrain.lightning_cli import PluginTrainCLI

        cli = PluginTrainCLI(args=None if argv is None else args)
    except ConfigError as error:
        # The last line printed, and the only one: the value and the fix.
        print(f"plugintrain {args[0]}: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        if not getattr(error, "one_line", False):
            raise
        # Bad input met during the run (a reward function's failure): one line, printed last.
        print(f"plugintrain {args[0]}: error: {error}", file=sys.stderr)
        return 2
    # 128 + the signal's number when a signal stopped the run (GracefulStop), else 0.
    status = getattr(cli, "exit_status", 0)
    if status and argv is None:  # a command's own process: no finalization to wait for
        from plugintrain.callbacks.graceful_stop import exit_stopped_process

        exit_stopped_process(status)
    return status


def checked_training_args(args: Sequence[str]) -> list[str]:
    """What :func:`main` checks of a training command before Lightning is imported: the
    command's name, the ``--config`` recipe (a packaged recipe's name becomes its file) and
    every ``--trainer.<name>``; ``args`` with the recipe resolved.

    Raises:
        ConfigError: With the one-line message ``main`` prints.
    """
    from plugintrain.tools import COMMANDS
    from plugintrain.tools.recipes import resolve_config_args

    _check_command(args[0], [*TRAINING_COMMANDS, *COMMANDS])
    resolved = resolve_config_args(args)  # --config NAME: a packaged recipe
    _check_trainer_options(resolved[1:])
    return resolved


def _check_command(command: str, commands: Sequence[str]) -> None:
    if command.startswith("-") or command in commands:
        return
    close = difflib.get_close_matches(command, commands, n=1)
    guess = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(
        f"unknown command {command!r}{guess} (`plugintrain --help` lists the commands)"
    )


def _check_trainer_options(args: Sequence[str]) -> None:
    """Refuse a ``--trainer.<name>`` that the Trainer does not take, before Lightning is
    imported (the full parser would refuse it too, seconds later); anything this cannot
    judge is left to that parser."""
    if any(arg in ("-h", "--help") or arg.startswith("--print_config") for arg in args):
        return
    given = [arg.split("=", 1)[0] for arg in args if arg.startswith("--trainer.")]
    known = trainer_options() if given else None
    for option in given if known is not None else ():
        name = option.removeprefix("--trainer.").split(".", 1)[0].removesuffix("+")
        if name not in known:
            raise ConfigError(unknown_option(option, [f"--trainer.{n}" for n in known]))


def __getattr__(name: str) -> Any:
    """:class:`~plugintrain.lightning_cli.PluginTrainCLI`, imported when first asked for."""
    if name == "PluginTrainCLI":
        from plugintrain.lightning_cli import PluginTrainCLI

        return PluginTrainCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
