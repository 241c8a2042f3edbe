"""Package faces whose names are imported from their modules on first use (PEP 562).

A face names each export once, under the module that defines it; :func:`lazy_exports` makes
the package's ``__all__`` and its module-level ``__getattr__`` from that one table, so
importing the package loads none of them (``--help`` of a command stays light).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _export_order(name: str) -> tuple[int, str]:
    """Constants, then classes, then the rest, each alphabetically (ruff's ``__all__`` order)."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and ``__getattr__`` of a package face.

    Args:
        package: The package's import name (its ``__name__``).
        modules: Submodule (relative to ``package``, dotted) -> the names it exports. A
            name the package defines itself is not listed here.

    Returns:
        The exports in ruff's ``__all__`` order, and the ``__getattr__`` that imports each
        from its module when first asked for.

    Raises:
        ValueError: When two modules claim one name (the face could export only one).
    """
    home: dict[str, str] = {}
    for module, names in modules.items():
        for name in names:
            if name in home:
                raise ValueError(f"{package}: {name!r} is exported by {home[name]} and {module}")
            home[name] = module

    def __getattr__(name: str) -> Any:
        """Each public name from its module, imported when first asked for."""
        if name in home:
            return getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(home, key=_export_order), __getattr__
