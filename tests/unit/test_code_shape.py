"""The library keeps the shape its architecture page promises.

Read by AST, no imports: functions short enough to read without scrolling, classes that
do one job, no import cycle among the project's modules, and the two faces of the
gradient engine (``zero.py`` and ``hybrid.py``) sharing code only through
``engine_binding.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Package folder -> the import name it installs under (pyproject's package-dir).
PACKAGES = {
    "plugintrain": "plugintrain",
    "strategies": "plugintrain.strategies",
    "model_zoo": "plugintrain.model_zoo",
    "precision_plugins": "plugintrain.precision_plugins",
}
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 270  # docstrings included; a strategy documents every init argument


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _imports(name: str, tree: ast.Module) -> set[str]:
    """Project modules imported at module level (not under ``TYPE_CHECKING``)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            # `from package import submodule` depends on the submodule; any other name
            # comes from the module itself (for a package, its __init__).
            base = node.module
            subs = [f"{base}.{alias.name}" for alias in node.names]
            candidates = [m if m in MODULES else base for m in subs]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in MODULES and c != name}
    return found


def test_no_function_or_class_is_too_long() -> None:
    too_long = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            else:
                continue
            if lines > limit:
                too_long.append(f"{name}.{node.name}: {lines} lines > {limit}")
    assert not too_long


def test_no_import_cycle() -> None:
    graph = {name: _imports(name, tree) for name, tree in _trees().items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail(f"import cycle: {' -> '.join([*path, nxt])}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("plugintrain.strategies.zero", "plugintrain.strategies.hybrid"),
        ("plugintrain.strategies.hybrid", "plugintrain.strategies.zero"),
    ],
)
def test_engine_faces_do_not_import_each_other(module: str, forbidden: str) -> None:
    assert forbidden not in _imports(module, _trees()[module])
