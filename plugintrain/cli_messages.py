"""What the ``plugintrain`` command line tells its user: the names it accepts, and errors.

A mistake on the command line or in a recipe is reported as one line that names the
value and the fix, printed last, with exit status 2. Left to themselves, jsonargparse
prints ~70 lines of usage before a bad option, and a class that refuses its arguments
(``seq_len`` beyond the model's context, an unknown preset) ends in two chained
tracebacks around a multi-line "Does not validate against any of the Union subtypes".
:func:`user_message` finds the line that matters in such a chain, and tells a user's
mistake from a bug, which keeps its traceback.

Importing it is cheap: Lightning and plugintrain's strategies are imported only by the
functions that list their names, so :mod:`plugintrain.cli` reports a mistyped command or
option before any of them loads.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import traceback
from argparse import ArgumentError
from collections.abc import Iterable, Sequence
from typing import Any

# What a user's mistake raises (and Lightning's MisconfigurationException); anything else
# is a bug and keeps its traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ArgumentError)
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_GOT_VALUE = re.compile(r"Got value: (\S+)$")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (\S+)")
_NOT_THE_VALUE = ("Expected a <class", "Does not validate against any of the Union subtypes")
"""How jsonargparse lists a union's alternatives that failed for being another type."""
_JSONARGPARSE = f"{os.sep}jsonargparse{os.sep}"


class ConfigError(ValueError):
    """A mistake in a ``plugintrain`` command or recipe, found before anything was launched.

    Its message is one line naming the value and the fix; ``plugintrain.cli.main`` prints
    it last and exits with status 2, without a traceback.
    """


def lightning_strategy_names() -> list[str]:
    """Lightning's own strategy names (``auto``, ``ddp``, ...), variants of ``ddp*`` with a
    ``find_unused_parameters`` suffix left out."""
    from lightning.pytorch.strategies import StrategyRegistry

    from plugintrain.strategies import STRATEGY_NAMES

    names = (n for n in StrategyRegistry if n not in STRATEGY_NAMES)
    return ["auto", *(n for n in names if "find_unused_parameters" not in n)]


def lightning_precision_names() -> list[str]:
    """The ``trainer.precision`` values Lightning accepts that plugintrain leaves to it."""
    from plugintrain.core.lightning_seam import precision_names
    from plugintrain.precision_plugins import PRECISION_PLUGINS

    return [n for n in precision_names() if n not in PRECISION_PLUGINS]


def strategy_help() -> str:
    """The ``--trainer.strategy`` names, plugintrain's with what each does."""
    from plugintrain.strategies.registry import STRATEGIES

    ours = ", ".join(f"{name} ({spec.description})" for name, spec in STRATEGIES.items())
    return (
        f"A name: plugintrain's {ours}; or Lightning's {', '.join(lightning_strategy_names())}."
        " Or a class path alone (the class's defaults), or a class_path with init_args."
    )


def precision_help() -> str:
    """The ``--trainer.precision`` names, plugintrain's first."""
    from plugintrain.precision_plugins import PRECISION_PLUGINS

    return (
        f"plugintrain's precision plugins: {', '.join(PRECISION_PLUGINS)} (FP32 master"
        " weights, a loss scaler aware of the parallel layout); Lightning's:"
        f" {', '.join(lightning_precision_names())}."
    )


def unknown_name(kind: str, value: object, ours: Iterable[str], theirs: Iterable[str]) -> str:
    """ "unknown strategy 'zero3'; did you mean 'zero2'? plugintrain's: ...; Lightning's: ..."."""
    ours, theirs = list(ours), list(theirs)
    close = difflib.get_close_matches(str(value).lower(), [*ours, *theirs], n=3, cutoff=0.6)
    guess = f"; did you mean {' or '.join(map(repr, close))}?" if close else ";"
    return (
        f"unknown {kind} {value!r}{guess} plugintrain's: {', '.join(ours)};"
        f" Lightning's: {', '.join(theirs)}"
    )


def strategy_class(strategy: Any) -> type | None:
    """The Strategy class a dotted ``trainer.strategy`` string names
    (``plugintrain.strategies.ZeroStrategy``), else None."""
    from lightning.pytorch.strategies import Strategy

    if not isinstance(strategy, str) or "." not in strategy:
        return None
    module, _, name = strategy.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):  # ValueError: ".x", an empty module
        return None
    return found if isinstance(found, type) and issubclass(found, Strategy) else None


def check_strategy_name(strategy: Any) -> None:
    """Refuse a ``trainer.strategy`` name that no one registered, before Lightning does
    (whose message knows neither plugintrain's names nor what was meant). A class path
    alone names that class with its defaults."""
    from lightning.pytorch.strategies import StrategyRegistry

    from plugintrain.strategies import STRATEGY_NAMES

    if not isinstance(strategy, str) or strategy.lower() in ("auto", *StrategyRegistry):
        return
    if strategy_class(strategy) is not None:
        return
    raise ValueError(unknown_name("strategy", strategy, STRATEGY_NAMES, lightning_strategy_names()))


def user_message(error: BaseException, options: Sequence[str] = ()) -> str | None:
    """The one-line message for a user's mistake; None when ``error`` is a bug.

    The innermost exception of the chain names the value (jsonargparse wraps what a class
    raised); an outer one may add the option it was given for (``Parser key "..."``).

    Args:
        error: What parsing or building the run raised.
        options: The parser's option strings, to suggest one for an unknown option.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from plugintrain.precision_plugins import PRECISION_PLUGINS

    chain = _chain(error)
    root = chain[-1]
    user = isinstance(root, (*_USER_ERRORS, MisconfigurationException))
    if not (user or _raised_in_jsonargparse(root)):
        return None
    # A union's last alternative (``str`` for a strategy) fails last; the error a class
    # raised for the user's values is the one that names them.
    message = _text(root)
    key = next((m.group(1) for e in chain if (m := _PARSER_KEY.search(_text(e)))), None)
    if key == "trainer.precision" and (value := _GOT_VALUE.search(message)):
        return unknown_name(
            "precision", value.group(1), PRECISION_PLUGINS, lightning_precision_names()
        )
    if message.startswith("Expected a <class"):
        # A union's `str` alternative failed last; the other alternative's error (what the
        # class raised for the user's values) is listed in an outer union error, maybe
        # nested in the union of a field (a config's `moe: MoEConfig | None`).
        for e in chain:
            items = [line.strip()[2:] for line in str(e).splitlines() if line.strip()[:2] == "- "]
            named = [item for item in items if not item.startswith(_NOT_THE_VALUE)]
            if named:
                return named[0].strip()
    if unrecognized := _UNRECOGNIZED.search(message):
        return unknown_option(unrecognized.group(1).split("=")[0], options)
    if message.startswith("the following arguments are required"):
        return f"{message}; a recipe sets them: --config recipes/<recipe>.yaml"
    return message if key is None or key in message else f"--{key}: {message}"


def unknown_option(option: str, options: Sequence[str]) -> str:
    """ "unknown option --trainer.max_step; did you mean --trainer.max_steps? ..."."""
    # An abbreviation of one option names it; a misspelling, the closest option.
    whole = [o for o in options if o.startswith(option)]
    close = whole if len(whole) == 1 else difflib.get_close_matches(option, options, 1, 0.8)
    guess = f"; did you mean {close[0]}?" if close else ""
    return f"unknown option {option}{guess} (options are never abbreviated; --help lists them)"


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, outermost first."""
    chain = [error]
    while True:
        last = chain[-1]
        cause = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if cause is None or cause in chain:
            return chain
        chain.append(cause)


def _text(error: BaseException) -> str:
    """The message on one line (a KeyError's without the quotes ``str`` adds)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(text.split())


def _raised_in_jsonargparse(error: BaseException) -> bool:
    """Whether jsonargparse itself raised ``error``: its type and value checks are the
    user's mistakes whatever exception class they use."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and _JSONARGPARSE in frames[-1].filename
