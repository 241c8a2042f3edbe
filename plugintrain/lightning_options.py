"""Lightning's ``Trainer`` options, read from its source without importing Lightning.

Importing Lightning takes seconds (it imports torch, dynamo and torchmetrics); a mistyped
``--trainer.max_step`` should not wait for that. The option names ``plugintrain fit`` takes
under ``--trainer.`` are the parameters of ``Trainer.__init__`` (LightningCLI adds the
class's arguments), which the installed package's source states.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

_TRAINER_SOURCE = ("pytorch", "trainer", "trainer.py")
"""Where ``lightning.pytorch.trainer.trainer`` lies in the ``lightning`` package."""


@functools.cache
def trainer_options() -> frozenset[str] | None:
    """The parameter names of the installed ``lightning.pytorch.Trainer.__init__``, or None
    when they cannot be read (then nothing is checked early)."""
    spec = importlib.util.find_spec("lightning")  # locates the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations)), *_TRAINER_SOURCE)
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    return _init_parameters(tree, "Trainer")


def _init_parameters(tree: ast.Module, name: str) -> frozenset[str] | None:
    """The named parameters of class ``name``'s ``__init__`` in ``tree`` (None if it takes
    ``**kwargs`` or is not there: then any name might be taken)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    if args.kwarg is not None:
                        return None
                    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                    return frozenset(a.arg for a in named[1:])  # without self
    return None
