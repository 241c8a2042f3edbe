"""docs/architecture.md's module map names every library file, and every file it names
exists: a new module, a move or a rename that forgets the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
FOLDERS = ("plugintrain", "strategies", "model_zoo", "precision_plugins")


def _library_files() -> list[Path]:
    return [
        path.relative_to(ROOT)
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
    ]


def _named(path: Path) -> bool:
    """Whether the map names ``path``: by its path, by its name in its folder's table, or
    through a ``folder/*.py`` row."""
    folder = path.parent.as_posix()
    return f"`{path.as_posix()}`" in DOC or f"`{path.name}`" in DOC or f"`{folder}/*.py`" in DOC


def test_the_module_map_names_every_library_file() -> None:
    assert [str(p) for p in _library_files() if not _named(p)] == []


def test_every_file_the_map_names_exists() -> None:
    names = {p.name for p in _library_files()} | {p.as_posix() for p in _library_files()}
    table = DOC[DOC.index("## Module map") : DOC.index("## The seams")]
    cited = set(re.findall(r"`([\w/]+\.py)`", table))
    assert sorted(c for c in cited if c not in names and not (ROOT / c).is_file()) == []
