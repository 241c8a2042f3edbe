"""Where each documented name of plugintrain lives, for the API reference and its links.

plugintrain installs three folders under its own name (``strategies/`` is
``plugintrain.strategies``, and so are ``model_zoo/`` and ``precision_plugins/``: setup.py's
package-dir mapping), which griffe, reading the files rather than importing them, cannot
follow. :func:`source_tree` lays out the installed package as links to the real folders;
griffe loads that. :class:`ApiIndex` answers, over the loaded package, the two questions the
reference needs: which modules get a page, and which object a name in a docstring means
(relative names, names a package face imports lazily, PEP 562, and unique short names
included), and whether that object has a page to link to.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "plugintrain"
FOLDERS = {
    "plugintrain": "plugintrain",
    "strategies": "plugintrain.strategies",
    "model_zoo": "plugintrain.model_zoo",
    "precision_plugins": "plugintrain.precision_plugins",
}
SOURCE = ROOT / "build" / "docs" / "src"
"""Where :func:`source_tree` lays out the installed package (``mkdocs.yml``'s ``paths``)."""


def source_tree(root: Path = ROOT, out: Path = SOURCE) -> Path:
    """``out/plugintrain``: links to every entry of ``plugintrain/`` and to the three
    folders it installs under its name; returns ``out``."""
    package = out / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    wanted = {entry.name: entry for entry in (root / PACKAGE).iterdir()}
    wanted |= {
        name.rpartition(".")[2]: root / folder
        for folder, name in FOLDERS.items()
        if folder != PACKAGE
    }
    for link in package.iterdir():
        if link.is_symlink() and (link.name not in wanted or link.resolve() != wanted[link.name]):
            link.unlink()
    for name, target in wanted.items():
        if not (package / name).is_symlink():
            with contextlib.suppress(FileExistsError):  # another build at the same time
                os.symlink(target, package / name)
    return out


def load(out: Path = SOURCE) -> griffe.Module:
    """plugintrain as griffe reads it from :func:`source_tree`."""
    return griffe.load(PACKAGE, search_paths=[str(source_tree(out=out))], try_relative_path=False)


def public(path: str) -> bool:
    """Whether no part of a dotted path is private (``_name``; dunders are public)."""
    return not any(p.startswith("_") and not p.startswith("__") for p in path.split("."))


def walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined in it, depth first (imports left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)


class ApiIndex:
    """Which objects of a loaded plugintrain the reference renders, and what a name in a
    docstring refers to."""

    def __init__(self, package: griffe.Module) -> None:
        self.package = package
        self.objects = {o.path: o for o in walk(package)}
        self._by_suffix: dict[str, set[str]] = defaultdict(set)
        for path in self.objects:
            parts = path.split(".")
            for i in range(1, len(parts)):
                self._by_suffix[".".join(parts[i:])].add(path)

    def modules(self) -> list[griffe.Module]:
        """Every public module and package, each of which gets a page."""
        return [o for p, o in sorted(self.objects.items()) if o.is_module and public(p)]

    def rendered(self, path: str) -> bool:
        """Whether the reference has an anchor for ``path`` (a public object of a public module)."""
        return path in self.objects and public(path)

    def resolve(self, scope: griffe.Object | None, name: str) -> str | None:
        """The path of the object ``name`` means in ``scope``'s docstring: an absolute
        ``plugintrain.`` path, a name seen from ``scope`` or one of its parents, or a
        dotted name only one object ends with. An import of something outside plugintrain
        resolves to its own path; None when nothing matches."""
        if name.startswith(f"{PACKAGE}."):
            return self._absolute(name)
        while scope is not None:
            found = self._follow(scope, name.split("."))
            if found is not None:
                return found
            scope = scope.parent
        matches = self._by_suffix.get(name, set())
        return next(iter(matches)) if len(matches) == 1 else None

    def _absolute(self, name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 1, -1):  # the longest prefix that is an object
            if (found := self._follow(self.package, parts[1:i])) is not None:
                break
        else:
            return None
        if i == len(parts):
            return found
        # A package face's lazy export (PEP 562 __getattr__), then the rest from there.
        home = self.home(found, parts[i])
        rest = parts[i + 1 :]
        return home if home is None or not rest else self._follow(self.objects[home], rest)

    def _follow(self, obj: griffe.Object, parts: list[str]) -> str | None:
        for part in parts:
            member = obj.members.get(part)
            if member is None:
                return None
            if member.is_alias:
                try:
                    member = member.final_target
                except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                    target = member.target_path  # outside plugintrain, or a lazy export
                    inside = target.startswith(f"{PACKAGE}.") and target != member.path
                    return self._absolute(target) if inside else target
            obj = member
        return obj.path

    def home(self, package: str, name: str) -> str | None:
        """Where ``package`` (or a module below it) defines ``name``, if only one does."""
        homes = {p for p in self._by_suffix.get(name, ()) if p.startswith(f"{package}.")}
        homes = {p for p in homes if p.count(".") == min(h.count(".") for h in homes)}
        return next(iter(homes)) if len(homes) == 1 else None
