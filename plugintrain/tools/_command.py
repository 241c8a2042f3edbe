"""plugintrain's commands beside training: typed functions whose parsers jsonargparse builds.

A command is one function. Its Google-style docstring is its description (the summary line
is what ``plugintrain --help`` lists) and its ``Args:`` the help of each option; its
signature is the parser, built by :meth:`jsonargparse.ArgumentParser.add_function_arguments`
as ``fit``'s is built from its classes:

- a parameter before ``*`` is a positional (``export CKPT OUT``): a ``list[str]`` one, the
  last, takes one or more words (``prepare text INPUT...``), one with a default may be
  left out (``recipes [NAME]``);
- a parameter after ``*`` is an option, required when it has no default (``--tokenizer``);
- a ``bool`` option that defaults to False is also a flag (``--overwrite`` alone is true);
- types are plain (``str``, ``int``, ``float``, ``bool``, ``Literal[...]``, ``X | None``)
  so that ``--help`` imports neither torch nor Lightning; the function imports them inside.

Every command also takes ``--config FILE`` (YAML or JSON of its options) and
``--print_config`` (the YAML of the resolved options). A mistake is one line, printed last,
naming the value and the fix, exit status 2: jsonargparse's own errors are rewritten so, an
unknown option gets a suggestion (options are never abbreviated), and a command raises
:class:`~plugintrain.cli_messages.ConfigError` for what only it can judge. The registry of
commands is :data:`plugintrain.tools.COMMANDS`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import io
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

from plugintrain.cli_messages import ConfigError, unknown_option

if TYPE_CHECKING:
    from jsonargparse import ArgumentParser

F = TypeVar("F", bound=Callable[..., Any])
_META = ("config", "print_config", "__path__")
"""Keys of a parsed namespace that are the parser's own, not the function's parameters."""
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*(.*)$', re.DOTALL)
_REQUIRED = re.compile(r'^Key "([^"]+)" is required')
_CLASS = re.compile(r"Expected a <class '(?:[\w.]+\.)?(\w+)'>")
_GIVEN = re.compile(r"(?:Got|Given) value: (.*)$", re.MULTILINE)
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_MISSING = "the following arguments are required: "


@dataclass(frozen=True)
class Group:
    """A command whose first word picks one of several functions (``prepare text``)."""

    description: str
    commands: Mapping[str, Callable[..., int]]


@dataclass(frozen=True)
class CommandSpec:
    """One ``plugintrain`` command as the registry lists it, without importing it."""

    target: str
    """``module:name`` of the command's function, or of its :class:`Group`."""
    examples: tuple[str, ...] = ()
    """Lines ``plugintrain --help`` shows under the summary."""
    passthrough: bool = False
    """The function takes the words as they are (``lm-eval``: another program's parser)."""

    def load(self) -> Callable[..., int] | Group:
        """The function (or group) itself, imported now."""
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


def aliases(**names: str | tuple[str, ...]) -> Callable[[F], F]:
    """Other option strings a command's parameters answer to, as in
    ``@aliases(weights="--ckpt_path")``: spellings the docs and recipes already use."""

    def mark(function: F) -> F:
        function.__option_aliases__ = {  # type: ignore[attr-defined]
            name: (spelt,) if isinstance(spelt, str) else spelt for name, spelt in names.items()
        }
        return function

    return mark


def shared_help(**texts: str) -> Callable[[F], F]:
    """Help of options several commands share, written once (``weights=WEIGHTS_HELP``);
    it stands in for the docstring's ``Args:`` entry of those parameters."""

    def mark(function: F) -> F:
        function.__option_help__ = texts  # type: ignore[attr-defined]
        return function

    return mark


def config_file(action: Callable[[], type], help: str) -> Callable[[F], F]:
    """A command whose ``--config`` reads more than a file of its options (``estimate``: a
    fit recipe too): ``action()`` is the ``ActionConfigFile`` subclass that reads it,
    imported only when the parser is built; ``help`` says what the option takes."""

    def mark(function: F) -> F:
        function.__config_file__ = (action, help)  # type: ignore[attr-defined]
        return function

    return mark


def description(command: Callable[..., Any] | Group) -> str:
    """What ``--help`` says a command does: its docstring without the ``Args:``."""
    if isinstance(command, Group):
        return command.description
    text = inspect.cleandoc(command.__doc__ or "")
    return re.split(r"\n\s*(?:Args|Returns|Raises):\s*\n", text)[0].strip()


def summary(command: Callable[..., Any] | Group) -> str:
    """The first sentence of a command's description: its line in ``plugintrain --help``."""
    return " ".join(description(command).split("\n\n")[0].split())


def build_parser(function: Callable[..., Any], prog: str) -> ArgumentParser:
    """The parser of ``function``'s command line, named ``prog`` in its messages."""
    from argparse import SUPPRESS

    from jsonargparse import ActionConfigFile

    parser = _parser_class()(
        prog=prog,
        description=description(function),
        exit_on_error=False,
        allow_abbrev=False,
        env_prefix=False,
        default_env=False,
    )
    config = getattr(function, "__config_file__", None)
    action, text = config or (lambda: ActionConfigFile, "a YAML or JSON file of options")
    parser.add_argument("--config", action=action(), help=text)
    # The annotations are strings (``from __future__ import annotations``); evaluated here
    # in the module's namespace, or jsonargparse evaluates them by running the module's
    # ``if TYPE_CHECKING:`` imports too, which import torch for ``--help``.
    function.__annotations__ = inspect.get_annotations(function, eval_str=True)
    own, lists = _own_positionals(function), _list_options(function)
    skip = {*own, *lists}
    parser.add_function_arguments(function, as_positional=True, as_group=False, skip=skip)
    helps = _param_help(function)
    for name, (item, nargs, default) in own.items():
        # Left out, a positional keeps what a --config file gave it (argparse would set its
        # default over it); the function's own default stands for it otherwise.
        default = {"default": SUPPRESS} if nargs == "?" else {}
        parser.add_argument(
            name, type=item, nargs=nargs, metavar=name.upper(), help=helps.get(name), **default
        )
    for name, (item, default) in lists.items():
        choices = {"choices": _literal(item)} if _literal(item) else {"type": item}
        parser.add_argument(
            f"--{name}", nargs="+", default=default, help=helps.get(name), **choices
        )
    shared = getattr(function, "__option_help__", {})
    for action in parser._actions:
        action.help = shared.get(action.dest, action.help)
        _shape(parser, action, getattr(function, "__option_aliases__", {}))
    return parser


def _own_positionals(function: Callable[..., Any]) -> dict[str, tuple[Any, str, Any]]:
    """The positionals jsonargparse does not make: a ``list[X]`` one (one or more words)
    and one with a default (may be left out); by name, their item type, nargs and default."""
    found = {}
    for param in inspect.signature(function, eval_str=True).parameters.values():
        if param.kind is not param.POSITIONAL_OR_KEYWORD:
            continue
        if get_origin(param.annotation) is list:
            found[param.name] = (get_args(param.annotation)[0], "+", None)
        elif param.default is not param.empty:
            inner = [t for t in get_args(param.annotation) if t is not type(None)]
            found[param.name] = (inner[0] if inner else param.annotation, "?", param.default)
    return found


def _list_options(function: Callable[..., Any]) -> dict[str, tuple[Any, Any]]:
    """The options that take one or more words (``--only A B``), which jsonargparse's list
    type does not: ``list[X]`` or ``list[X] | None`` after ``*``; their item type and
    default."""
    found = {}
    for param in inspect.signature(function, eval_str=True).parameters.values():
        kinds = [param.annotation, *get_args(param.annotation)]
        lists = [t for t in kinds if get_origin(t) is list]
        if param.kind is param.KEYWORD_ONLY and lists:
            found[param.name] = (get_args(lists[0])[0], param.default)
    return found


def _param_help(function: Callable[..., Any]) -> dict[str, str]:
    from docstring_parser import parse

    return {p.arg_name: p.description or "" for p in parse(function.__doc__ or "").params}


def _shape(parser: ArgumentParser, action: Any, names: Mapping[str, tuple[str, ...]]) -> None:
    """What the signature cannot say: positionals shown in capitals, a false ``bool``
    option that is also a flag, and the aliases of an option."""
    if not action.option_strings and action.dest not in ("help",):
        action.metavar = action.metavar or action.dest.upper()
        return
    typehint = getattr(action, "_typehint", None)
    if typehint is bool and action.default is False:
        action.nargs, action.const, action.metavar = "?", True, "{true,false}"
    elif choices := _literal(typehint):
        action.metavar = "{" + ",".join(map(str, choices)) + "}"
    for alias in names.get(action.dest, ()):
        action.option_strings.append(alias)
        parser._option_string_actions[alias] = action


def _literal(typehint: Any) -> tuple[Any, ...]:
    """The values of ``Literal[...]`` or ``Literal[...] | None``; empty for another type."""
    if get_origin(typehint) is Literal:
        return get_args(typehint)
    inner = [t for t in get_args(typehint) if t is not type(None)]
    return get_args(inner[0]) if len(inner) == 1 and get_origin(inner[0]) is Literal else ()


def _one_line(message: str, parser: ArgumentParser) -> str:
    """jsonargparse's error as one line naming the option and the fix."""
    text = message.strip()
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    if text.startswith("unrecognized arguments: "):
        first = text.split()[2]
        if first.startswith("-"):
            return unknown_option(first.split("=", 1)[0], options)
        return f"unexpected argument {first!r} (--help lists the arguments)"
    if key := _NOT_ACCEPTED.search(text):  # a key of a --config file
        return unknown_option(f"--{key.group(1)}", options)
    if required := _REQUIRED.match(text):
        return f"--{required.group(1)} is required (--help lists the options)"
    if text.startswith(_MISSING):
        names = [n.strip() for n in text.removeprefix(_MISSING).split(",")]
        shown = [f"--{n}" if f"--{n}" in options else n.upper() for n in names]
        return f"{_MISSING}{', '.join(shown)} (--help lists them)"
    if keyed := _PARSER_KEY.match(text):
        return _bad_value(parser, *keyed.groups())
    return " ".join(text.split())


def _bad_value(parser: ArgumentParser, key: str, reason: str) -> str:
    """``--KEY VALUE: what is wrong`` from jsonargparse's multi-line type error."""
    value = next((m.group(1) for m in _GIVEN.finditer(reason)), None)
    shown = f"--{key}" if value is None else f"--{key} {value}"
    action = next((a for a in parser._actions if a.dest == key), None)
    if choices := _literal(getattr(action, "_typehint", None)):
        return f"{shown}: choose from {', '.join(map(str, choices))}"
    if expected := _CLASS.search(reason):
        kind = expected.group(1)
        return f"{shown}: expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    return f"{shown}: {' '.join(reason.split())}"


@functools.cache
def _parser_class() -> type:
    """jsonargparse's ``ArgumentParser`` with the error turned into one exception, whose
    message :func:`run` prints as one line (jsonargparse prints the usage first), and
    help that says what is required and the default the help text does not already."""
    from argparse import SUPPRESS, _HelpAction

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter):
        def _get_help_string(self, action: Any) -> str:
            text = action.help or ""
            if isinstance(action, (ActionConfigFile, _HelpAction)):
                return super()._get_help_string(action)
            if not action.option_strings:  # a positional, always required
                return text
            if action.required:
                return f"{text} (required)"
            if "default" in text or action.default in (None, False, "", SUPPRESS):
                return text
            return f"{text} (default: %(default)s)"

    class OneLineParser(ArgumentParser):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(formatter_class=Formatter, **kwargs)

        def error(self, message: str, ex: Exception | None = None) -> Any:
            raise ConfigError(_one_line(message, self)) from ex

    return OneLineParser


def parse(function: Callable[..., Any], argv: Sequence[str], prog: str) -> dict[str, Any]:
    """The keyword arguments ``function`` is called with for the words ``argv``.

    Raises:
        ConfigError: The one-line refusal.
        SystemExit: With status 0, after ``--help`` or ``--print_config`` printed.
    """
    parser = build_parser(function, prog)
    namespace = parser.parse_args(list(argv))
    return {k: v for k, v in namespace.as_dict().items() if k not in _META}


def refusal(name: str, spec: CommandSpec, argv: Sequence[str]) -> str | None:
    """The one-line refusal ``plugintrain NAME ARGV`` would print while parsing, or None
    when the words parse (or ask for help); nothing runs. For the docs' command checks."""
    command = spec.load()
    prog = f"plugintrain {name}"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if isinstance(command, Group):
                function, prog, argv = _pick(command, prog, argv)
            else:
                function = command
            parse(function, argv, prog)
    except ConfigError as error:
        return f"{prog}: error: {error}"
    except SystemExit as exit_:
        return None if exit_.code in (0, None) else f"{prog}: exits {exit_.code}"
    return None


def run(name: str, spec: CommandSpec, argv: Sequence[str]) -> int:
    """Run ``plugintrain <name> ARGV``: 0 on success, 2 after a one-line refusal."""
    command = spec.load()
    prog = f"plugintrain {name}"
    try:
        if spec.passthrough:
            return command(list(argv))
        if isinstance(command, Group):
            function, prog, argv = _pick(command, prog, argv)
        else:
            function = command
        kwargs = parse(function, argv, prog)
        return function(**kwargs)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help and --print_config end here (and lm-eval's parser)
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)


def _pick(
    group: Group, prog: str, argv: Sequence[str]
) -> tuple[Callable[..., int], str, list[str]]:
    """The function of a group's first word, its name and the words after it."""
    names = list(group.commands)
    if not argv:
        raise ConfigError(f"{_MISSING}COMMAND (one of {', '.join(names)}; --help lists them)")
    if argv[0] in ("-h", "--help"):
        print(group_help(group, prog))
        raise SystemExit(0)
    if argv[0] not in group.commands:
        close = difflib.get_close_matches(argv[0], names, n=1)
        guess = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"unknown {prog.split()[-1]} command {argv[0]!r}{guess}; choose from {', '.join(names)}"
        )
    return group.commands[argv[0]], f"{prog} {argv[0]}", list(argv[1:])


def group_help(group: Group, prog: str) -> str:
    """What ``plugintrain prepare --help`` prints: the group's commands, one line each."""
    width = max(map(len, group.commands))
    rows = [f"  {name:<{width}}  {summary(f)}" for name, f in group.commands.items()]
    return "\n".join(
        [
            f"usage: {prog} {{{','.join(group.commands)}}} [options]",
            "",
            group.description,
            "",
            "commands:",
            *rows,
            "",
            f"Run `{prog} <command> --help` for the options of one command.",
        ]
    )


def parsers(name: str, spec: CommandSpec) -> dict[str, ArgumentParser]:
    """Every parser of a command by its full name (``prepare text``, ...); empty for a
    pass-through command."""
    command = spec.load()
    if spec.passthrough:
        return {}
    if isinstance(command, Group):
        return {
            f"{name} {sub}": build_parser(f, f"plugintrain {name} {sub}")
            for sub, f in command.commands.items()
        }
    return {name: build_parser(command, f"plugintrain {name}")}
