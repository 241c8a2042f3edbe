"""The commands the documentation shows, found and checked against the real command line.

Every shell command of README.md and docs/**/*.md is found with its file and line: each
line of a fenced ``bash``/``sh``/``shell`` block (a trailing backslash continues it), each
``$ `` line of a ``console`` block (the lines after it are its output), and every inline
code span that starts with ``plugintrain``. Then each is checked as the shell would hand it
to its program, in this process, with the program's own parser:

- ``plugintrain fit|validate|test|predict ...``: the checks ``plugintrain`` makes before
  Lightning loads (command, recipe, ``--trainer.*`` names), then LightningCLI's own parser
  (:func:`plugintrain.lightning_cli.training_parser`, built once): every option exists and
  every value parses, the recipe included; then the strategy name. Nothing is built or run.
- ``plugintrain <command> ...``: the command's own parser (built from its function,
  :mod:`plugintrain.tools._command`), which parses and runs nothing; a pass-through command
  (``lm-eval``) and ``python benchmarks/<script>.py ...``: the program's own ``argparse``
  parser, stopped right after it parsed.
- ``torchrun ... -m plugintrain ...``: torchrun's parser, then the plugintrain command;
  ``srun ... plugintrain ...``: the plugintrain command; ``sbatch FILE``: the file exists.
- ``make TARGET VAR=...``: the target and the variable are in the Makefile.
- ``pytest PATH``: the path exists.

Cheap commands also run (``--help``, ``plugintrain recipes``, ``plugintrain schedule``
without ``--model``, ``plugintrain estimate`` without ``--dry_run`` or ``--fit``) and must
exit 0. A ``console`` command whose output shows ``plugintrain <command>: error: MESSAGE``
must be refused with that message (a trailing ``...`` stands for the rest of it), and so must
the inline commands of a line marked ``<!-- refused -->``. An inline code span may leave out
required arguments and option values (it names a command in prose); everything else it
says must parse.

``python docs/hooks/commands.py`` prints one line per problem, ``FILE:LINE: what``, and
exits 1 if there is any; ``make docs`` runs it before the build, and so does the test
suite (``tests/unit/test_docs_commands.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
PLUGINTRAIN = ("plugintrain", ".venv/bin/plugintrain")
PYTHONS = ("python", "python3", ".venv/bin/python")
PYTESTS = ("pytest", ".venv/bin/pytest")
# Programs whose commands the docs show but that are not ours to check.
EXTERNAL = (
    "tensorboard",
    ".venv/bin/tensorboard",
    "pip",
    ".venv/bin/pip",
    "git",
    "cd",
    "nsys",
    "mlflow",
    ".venv/bin/mlflow",
    "wandb",
    ".venv/bin/wandb",
    "comet",
    ".venv/bin/comet",
)
SHELL_OPERATORS = (">", ">>", "|", "&&", "||", ";", "<", "2>&1", "&")
TRAINING = ("fit", "validate", "test", "predict")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_INLINE = re.compile(r"(?<!`)`((?:\.venv/bin/)?plugintrain [^`]+)`(?!`)")
_SHOWN_ERROR = re.compile(r"^plugintrain [\w-]+: error: (.*)$")
REFUSED = "<!-- refused -->"
"""Marks a line whose inline commands the docs show being refused (a typo on purpose)."""


@dataclass(frozen=True)
class Command:
    """One command the docs show: where, what, and what they say it does."""

    path: Path
    line: int
    text: str
    inline: bool = False
    """An inline code span in prose (may leave out required arguments)."""
    shown_error: str | None = None
    """The error message a ``console`` block shows it ending with, if any."""

    @property
    def argv(self) -> list[str]:
        """The words the shell would pass, up to the first redirection or pipe; leading
        ``VAR=value`` assignments and a ``$`` prompt left out."""
        words = shlex.split(self.text, comments=True)
        cut = next((i for i, w in enumerate(words) if w in SHELL_OPERATORS), len(words))
        words = words[:cut]
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words.pop(0)
        return words


@dataclass(frozen=True)
class Problem:
    """A command the real command line would not take as the docs show it."""

    command: Command
    message: str

    def __str__(self) -> str:
        where = (
            self.command.path.relative_to(ROOT)
            if self.command.path.is_relative_to(ROOT)
            else self.command.path
        )
        return f"{where}:{self.command.line}: {self.message} (in `{self.command.text}`)"


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page of the documentation site."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def extract(path: Path) -> list[Command]:
    """Every command of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    fence: tuple[str, str] | None = None  # (marker, language) of the open block
    block: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, block = (match.group(2), match.group(3).lower()), []
        elif fence is not None and line.strip().startswith(fence[0]):
            if fence[1] in SHELL_BLOCKS:
                commands += _block_commands(path, block, console=fence[1] == "console")
            fence = None
        elif fence is not None:
            block.append((number, line))
        else:
            refused = "" if REFUSED in line else None
            commands += [
                Command(path, number, span.group(1), inline=True, shown_error=refused)
                for span in _INLINE.finditer(line)
            ]
    return commands


def _block_commands(path: Path, block: list[tuple[int, str]], console: bool) -> list[Command]:
    """The commands of one fenced shell block (joined across trailing backslashes)."""
    commands: list[Command] = []
    start, text = 0, ""
    for number, raw in block:
        line = raw.strip()
        if text:  # a continuation line
            text = f"{text[:-1].rstrip()} {line}"
        elif console and not line.startswith("$ "):
            shown = _SHOWN_ERROR.match(line)
            if shown and commands:
                commands[-1] = Command(
                    path, commands[-1].line, commands[-1].text, False, shown.group(1)
                )
            continue
        elif not line or line.startswith("#"):
            continue
        else:
            start, text = number, line.removeprefix("$ ")
        if not text.endswith("\\"):
            commands.append(Command(path, start, text))
            text = ""
    return commands


@dataclass
class Checker:
    """Checks commands against the real parsers; builds LightningCLI's parser once."""

    root: Path = ROOT
    run_cheap: bool = True
    _training: Any = field(default=None, repr=False)

    def check(self, commands: Sequence[Command]) -> list[Problem]:
        """Every problem of ``commands``, in order."""
        problems = []
        for command in commands:
            try:
                argv = command.argv
            except ValueError as error:  # unbalanced quotes
                problems.append(Problem(command, f"not a shell command: {error}"))
                continue
            message = self._check(command, argv) if argv else None
            if message is not None:
                problems.append(Problem(command, message))
        return problems

    def _check(self, command: Command, argv: list[str]) -> str | None:
        program, args = argv[0], argv[1:]
        if program in PLUGINTRAIN:
            return self._plugintrain(command, args)
        if program in PYTHONS:
            return self._python(command, args)
        if program == "torchrun":
            return self._torchrun(command, args)
        if program == "srun":
            rest = args[args.index("plugintrain") + 1 :] if "plugintrain" in args else None
            return (
                "srun starts no plugintrain command"
                if rest is None
                else self._plugintrain(command, rest)
            )
        if program == "sbatch":
            return _exists(self.root, args[-1]) if args else "sbatch without a script"
        if program == "make":
            return _make(self.root / "Makefile", args)
        if program in PYTESTS:
            return next(filter(None, (_exists(self.root, a) for a in _pytest_paths(args))), None)
        if program in EXTERNAL:
            return None
        return f"unknown program {program!r} (docs/hooks/commands.py checks the programs it knows)"

    def _python(self, command: Command, args: list[str]) -> str | None:
        if args[:2] == ["-m", "plugintrain"]:
            return self._plugintrain(command, args[2:])
        if args[:1] == ["-m"] and len(args) > 1:
            module = args[1]
            if not module.startswith("plugintrain."):
                return None  # python -m pip ...: not ours to check (nor to run)
            return _parse_only(
                lambda: runpy.run_module(module, run_name="__main__"), [module, *args[2:]]
            )
        if args and args[0].endswith(".py"):
            if (problem := _exists(self.root, args[0])) is not None:
                return problem
            return _parse_only(lambda: _run_script(self.root / args[0]), args)
        return None  # python -c ...: not a command the docs teach

    def _torchrun(self, command: Command, args: list[str]) -> str | None:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
        parser.exit_on_error = False
        try:
            options = parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as error:
            return f"torchrun refuses its options: {error}"
        if not (options.module and options.training_script == "plugintrain"):
            return "torchrun starts no plugintrain command (`torchrun ... -m plugintrain ...`)"
        return self._plugintrain(command, list(options.training_script_args))

    def _plugintrain(self, command: Command, args: list[str]) -> str | None:
        from plugintrain.tools import COMMANDS
        from plugintrain.tools._command import refusal

        if not args or args[0] in ("-h", "--help"):
            return self._run(command, args) if self.run_cheap else None
        if args[0] in COMMANDS:
            spec = COMMANDS[args[0]]
            problem = (
                _parse_only(lambda: spec.load()(args[1:]), ["plugintrain", *args])
                if spec.passthrough
                else refusal(args[0], spec, args[1:])
            )
            problem = _allow_missing(problem, command)
            if problem is None and self.run_cheap and not command.inline and _cheap(args):
                return self._run(command, args)
            return _expected(command, problem)
        return _expected(command, _allow_missing(self._training_problem(args), command))

    def _training_problem(self, args: list[str]) -> str | None:
        """The one-line refusal ``plugintrain`` would print for a training command before
        building anything, or None."""
        from plugintrain.cli import checked_training_args
        from plugintrain.cli_messages import ConfigError, check_strategy_name, user_message

        try:
            resolved = checked_training_args(args)
            if any(a in ("-h", "--help") for a in resolved):
                return None
            with contextlib.redirect_stdout(io.StringIO()):  # --print_config prints, exits 0
                config = self.training_parser.parse_args(resolved)
            check_strategy_name(config[resolved[0]].trainer.strategy)
        except SystemExit as exit_:
            return None if exit_.code in (0, None) else f"exits {exit_.code}"
        except ConfigError as error:
            return str(error)
        except Exception as error:
            options = self.training_parser._subcommands_action._name_parser_map[args[0]]
            return user_message(error, sorted(options._option_string_actions)) or str(error)
        return None

    @property
    def training_parser(self) -> Any:
        """LightningCLI's parser of ``plugintrain fit|validate|test|predict`` (built once)."""
        if self._training is None:
            from plugintrain.lightning_cli import training_parser

            self._training = training_parser()
        return self._training

    def _run(self, command: Command, args: list[str]) -> str | None:
        """Run a cheap ``plugintrain`` command here; a problem unless it exits 0."""
        from plugintrain.cli import main

        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(args)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        if status != 0:
            last = (err.getvalue().strip().splitlines() or ["(nothing printed)"])[-1]
            return f"exits {status}: {last}"
        return None


class _Parsed(Exception):
    """Stops a program right after its argument parser parsed."""


def _parse_only(run: Callable[[], Any], argv: Sequence[str]) -> str | None:
    """Run ``run`` until its first ``argparse`` parse and stop it there: None if the
    arguments parse (or ask for help), else the parser's error line."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        real(parser, *args, **kwargs)
        raise _Parsed

    err = io.StringIO()
    saved = sys.argv
    sys.argv = list(argv)
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(err),
        ):
            run()
    except _Parsed:
        return None
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return None
        return (err.getvalue().strip().splitlines() or [f"exit status {exit_.code}"])[-1]
    finally:
        sys.argv = saved
    return "ran without parsing any argument"


def passthrough_parser(command: str) -> argparse.ArgumentParser:
    """The ``argparse`` parser of a pass-through ``plugintrain <command>`` (``lm-eval``:
    another program's own), caught at its first parse, before it parses anything.

    Raises:
        RuntimeError: If the command parsed nothing (lm-eval without lm_eval installed).
    """
    from plugintrain.tools import COMMANDS

    caught: list[argparse.ArgumentParser] = []

    def catch(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        caught.append(parser)
        raise _Parsed

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", catch),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(err := io.StringIO()),
        contextlib.suppress(_Parsed),
    ):
        COMMANDS[command].load()(["--help"])
    if not caught:
        raise RuntimeError(f"plugintrain {command} parsed no arguments: {err.getvalue().strip()}")
    return caught[0]


def _run_script(path: Path) -> None:
    sys.path.insert(0, str(path.parent))  # the script's own helpers (benchmarks/_timing.py)
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.path.remove(str(path.parent))


def _allow_missing(problem: str | None, command: Command) -> str | None:
    """An inline span names a command, or one of its options, in prose: missing required
    arguments and an option shown without its value are fine."""
    fragment = ("arguments are required", "expected one argument", "is required")
    if problem and command.inline and any(f in problem for f in fragment):
        return None
    return problem


def _expected(command: Command, problem: str | None) -> str | None:
    """Compare the outcome with the error a ``console`` block shows, if it shows one."""
    shown = command.shown_error
    if shown is None:
        return problem
    if problem is None:
        return f"the docs show it refused ({shown}), but it parses"
    problem = _SHOWN_ERROR.sub(r"\1", problem)
    if not problem.startswith(shown.removesuffix("...").rstrip()):
        return f"the docs show the error {shown!r}; plugintrain prints {problem!r}"
    return None


def _cheap(args: Sequence[str]) -> bool:
    """Whether a tool command is cheap enough to run on every check."""
    tool, options = args[0], set(args[1:])
    if options & {"-h", "--help"}:
        return True
    if tool == "recipes":
        return True
    if tool == "schedule":
        return "--model" not in options
    return tool == "estimate" and not options & {"--dry_run", "--fit", "--config"}


def _exists(root: Path, name: str) -> str | None:
    return None if (root / name.split("::")[0]).exists() else f"no such file: {name}"


def _pytest_paths(args: Sequence[str]) -> Iterator[str]:
    takes_value = {"-m", "-k", "-n", "-p", "--dist", "-o"}
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            yield arg


def _make(makefile: Path, args: Sequence[str]) -> str | None:
    text = makefile.read_text()
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.MULTILINE))
    variables = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:]?=", text, re.MULTILINE))
    for arg in args:
        name, equals, _ = arg.partition("=")
        if equals and name not in variables:
            return f"the Makefile has no variable {name}"
        if not equals and not arg.startswith("-") and arg not in targets:
            return f"the Makefile has no target {arg!r}"
    return None


def check_docs(files: Sequence[Path] | None = None, run_cheap: bool = True) -> list[Problem]:
    """Every problem of every command in ``files`` (README.md and docs/ by default)."""
    commands = [c for path in files or doc_files() for c in extract(path)]
    return Checker(run_cheap=run_cheap).check(commands)


def main() -> int:
    problems = check_docs()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in the commands of README.md and docs/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
