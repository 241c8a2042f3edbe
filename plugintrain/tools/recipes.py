"""``plugintrain recipes``, and recipe names for ``--config``: the recipes the package ships.

The YAML files of ``recipes/`` install as the package data of ``plugintrain.recipes``, so
a pip install trains without a checkout: ``plugintrain fit --config gpt2_debug_shakespeare_cpu``
(or ``gpt2_debug_shakespeare_cpu.yaml``, or ``recipes/gpt2_debug_shakespeare_cpu.yaml`` as
the README writes it) reads the packaged recipe when no file of that name exists, as
LitGPT's config hub does for ``litgpt finetune --config``. A file that exists always wins.

Nothing here imports torch or Lightning: :func:`resolve_config_args` runs before
LightningCLI is built, and ``plugintrain recipes`` needs neither.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path, PurePath

from plugintrain.cli_messages import ConfigError

PACKAGE = "plugintrain.recipes"
SUFFIX = ".yaml"
_CONFIG_FLAGS = ("--config", "-c")
# A value that could name a recipe: a bare name, or one under recipes/. Anything else (a
# path elsewhere, jsonargparse's inline YAML such as '{trainer: {max_steps: 3}}') is left
# for jsonargparse to read as it always has.
_NAME_LIKE = re.compile(r"(?:\./)?(?:recipes/)?[\w.-]+")


def recipe_names() -> list[str]:
    """The names of the packaged recipes, sorted (file names without ``.yaml``)."""
    found = (entry.name for entry in files(PACKAGE).iterdir())
    return sorted(name.removesuffix(SUFFIX) for name in found if name.endswith(SUFFIX))


def recipe_path(name: str) -> Path:
    """The packaged YAML file of recipe ``name`` (a wheel installs it as a plain file)."""
    return Path(str(files(PACKAGE) / f"{name}{SUFFIX}"))


def description(text: str) -> str:
    """A recipe's one-line description: the first line of its leading comment, ending in
    "…" where the comment's sentence goes on."""
    first = text.lstrip().partition("\n")[0]
    if not first.startswith("#"):
        return ""
    line = first.removeprefix("#").strip()
    return line if line.endswith(".") else f"{line.rstrip(':,')}…"


def no_recipe(value: str) -> str:
    """One line for a ``value`` that names no packaged recipe, with the names close to it."""
    name = _as_name(value)
    names = recipe_names()
    close = [n for n in names if name and name in n] or difflib.get_close_matches(name, names)
    guess = f"; did you mean {_either(close[:3])}?" if close else ""
    return f"no recipe is named {name!r}{guess} (`plugintrain recipes` lists the recipes)"


def resolve_config(value: str) -> str:
    """What ``--config VALUE`` reads: ``VALUE`` itself when it is a file (or no recipe
    name could be meant), else the packaged recipe it names.

    Raises:
        ConfigError: If ``VALUE`` looks like a recipe name but none is named so.
    """
    if Path(value).is_file() or not _NAME_LIKE.fullmatch(value):
        return value
    if _as_name(value) in recipe_names():
        return str(recipe_path(_as_name(value)))
    raise ConfigError(f"--config: File does not exist: {value!r}, and {no_recipe(value)}")


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """``args`` with the value of every ``--config X``, ``--config=X`` and ``-c X``
    resolved by :func:`resolve_config`; every other argument unchanged."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, equals, value = arg.partition("=")
        if equals and flag in _CONFIG_FLAGS:
            out[i] = f"{flag}={resolve_config(value)}"
        elif arg in _CONFIG_FLAGS and i + 1 < len(out) and not out[i + 1].startswith("-"):
            out[i + 1] = resolve_config(out[i + 1])
    return out


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def _as_name(value: str) -> str:
    """``recipes/NAME.yaml``, ``NAME.yaml`` or ``NAME`` -> ``NAME``."""
    return PurePath(value).name.removesuffix(SUFFIX)


def _listing() -> str:
    """Every packaged recipe with its description, in aligned columns."""
    names = recipe_names()
    width = max(map(len, names), default=0)
    rows = [f"  {n:<{width}}  {description(recipe_path(n).read_text())}" for n in names]
    header = "Recipes shipped with plugintrain (train one: plugintrain fit --config NAME):"
    return "\n".join([header, *rows, "", "plugintrain recipes NAME prints one."])


def recipes(name: str | None = None) -> int:
    """List the recipes shipped with plugintrain, or print one to copy and edit.

    `plugintrain fit --config NAME` trains a recipe by its name; copy one to edit it:
    plugintrain recipes gpt2_debug_shakespeare_cpu > my.yaml

    Args:
        name: print this recipe's YAML (default: list them)
    """
    if name is None:
        print(_listing())
    elif _as_name(name) in recipe_names():
        sys.stdout.write(recipe_path(_as_name(name)).read_text())
    else:
        raise ConfigError(no_recipe(name))
    return 0
