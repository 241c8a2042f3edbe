"""The library keeps the shape its architecture page promises.

Read by AST, nothing imported: functions short enough to read without scrolling, classes
that do one job, packages in layers (a floor that imports nothing of the project, one
checkpoints package on it, the plugins and models above, the commands on top), no import
cycle at any depth (an import inside a function or under ``TYPE_CHECKING`` is an arrow
like any other), and the two faces of the gradient engine (``zero.py`` and ``hybrid.py``)
sharing code only through ``engine_binding.py``. Each checker is also run on a planted
fault, so a checker that stopped seeing faults would fail here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
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
MAX_CLASS_LINES = 240  # docstrings included
# Classes whose every option is a documented argument or field (what `--help` and
# `--print_config` print): the strategies' Lightning faces and the model config.
DOCUMENTED_OPTIONS = {"TransformerConfig", "HybridParallelStrategy", "ParallelDims"}
MAX_DOCUMENTED_CLASS_LINES = 270

# The layers, bottom up: what each package may import of the project (besides itself).
# Packages not listed (cli, cli_messages, tools, callbacks, bench, estimate, __main__)
# are the roof, which may import anything; `plugintrain` itself (the package root) wires
# the one seam implemented above its users (core.pretrained <- formats).
FLOOR = "plugintrain.core"
LAYERS: dict[str, set[str]] = {
    FLOOR: set(),
    "plugintrain.checkpoints": {FLOOR},
    "plugintrain.data": {FLOOR},
    "plugintrain.precision_plugins": {FLOOR},
    "plugintrain.model_zoo": {FLOOR, "plugintrain.checkpoints"},
    "plugintrain.strategies": {FLOOR, "plugintrain.checkpoints", "plugintrain.precision_plugins"},
    "plugintrain.formats": {
        FLOOR,
        "plugintrain.checkpoints",
        "plugintrain.data",
        "plugintrain.model_zoo",
    },
}
ROOF = ("cli", "cli_messages", "tools", "callbacks", "bench", "estimate")
"""What strategies, model_zoo and precision_plugins may never import (with formats)."""


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


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The module a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    package = name.split(".")
    if MODULES[name].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imports(name: str, tree: ast.Module, modules: Iterable[str] = MODULES) -> set[str]:
    """Project modules ``name`` imports anywhere: at module level, in functions, under
    ``TYPE_CHECKING``."""
    known = set(modules)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            # `from package import submodule` depends on the submodule; any other name
            # comes from the module itself (for a package, its __init__).
            base = _absolute(name, node)
            subs = [f"{base}.{alias.name}" for alias in node.names]
            candidates = [m if m in known else base for m in subs]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def _graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    return {name: _imports(name, tree, trees) for name, tree in trees.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path, None if it has none."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def _package(module: str) -> str:
    """The layer package a module belongs to (its first two name parts)."""
    return ".".join(module.split(".")[:2])


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points to a package its layer may not import."""
    bad = []
    for module, imported in sorted(graph.items()):
        allowed = LAYERS.get(_package(module))
        if allowed is None:
            continue
        for target in sorted(imported):
            owner = _package(target)
            if owner != _package(module) and owner not in allowed:
                bad.append(f"{module} -> {target}")
    return bad


def _plant(trees: dict[str, ast.Module], module: str, source: str) -> dict[str, ast.Module]:
    """``trees`` with ``source`` appended to ``module``'s code."""
    planted = dict(trees)
    planted[module] = ast.Module(body=[*trees[module].body, *ast.parse(source).body])
    return planted


def test_no_function_or_class_is_too_long() -> None:
    too_long = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                documented = node.name in DOCUMENTED_OPTIONS
                limit = MAX_DOCUMENTED_CLASS_LINES if documented else MAX_CLASS_LINES
            else:
                continue
            if lines > limit:
                too_long.append(f"{name}.{node.name}: {lines} lines > {limit}")
    assert not too_long


def test_no_import_cycle_at_any_depth() -> None:
    cycle = _cycle(_graph(_trees()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_a_planted_function_level_circle_is_found() -> None:
    trees = _trees()
    planted = _plant(
        trees,
        "plugintrain.core.tensor_boxes",
        "def late():\n    from plugintrain.core.initialization import seeded_normal_\n",
    )
    assert _cycle(_graph(trees)) is None
    assert _cycle(_graph(planted)) == [
        "plugintrain.core.tensor_boxes",
        "plugintrain.core.initialization",
        "plugintrain.core.tensor_boxes",
    ]


def test_every_package_stays_in_its_layer() -> None:
    assert _layer_violations(_graph(_trees())) == []


@pytest.mark.parametrize(
    ("module", "source", "arrow"),
    [
        (
            "plugintrain.core.contracts",
            "def f():\n    from plugintrain.strategies.mesh import ParallelDims\n",
            "plugintrain.core.contracts -> plugintrain.strategies.mesh",
        ),
        (
            "plugintrain.checkpoints.dcp",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from plugintrain.strategies.grad_engine import GradientEngine\n",
            "plugintrain.checkpoints.dcp -> plugintrain.strategies.grad_engine",
        ),
        (
            "plugintrain.model_zoo.lm",
            "def f():\n    from plugintrain.formats import open_weights\n",
            "plugintrain.model_zoo.lm -> plugintrain.formats",
        ),
        (
            "plugintrain.strategies.hybrid",
            "import plugintrain.cli\n",
            "plugintrain.strategies.hybrid -> plugintrain.cli",
        ),
    ],
)
def test_a_planted_upward_import_is_found(module: str, source: str, arrow: str) -> None:
    assert _layer_violations(_graph(_plant(_trees(), module, source))) == [arrow]


@pytest.mark.parametrize(
    "package", ["plugintrain.strategies", "plugintrain.model_zoo", "plugintrain.precision_plugins"]
)
def test_plugins_and_models_never_import_the_roof(package: str) -> None:
    """The issue's rule, spelled out (the layer table above implies it)."""
    roof = {f"plugintrain.{name}" for name in (*ROOF, "formats")}
    graph = _graph(_trees())
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _package(m) == package
        for t in targets
        if _package(t) in roof
    ]
    assert upward == []


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("plugintrain.strategies.zero", "plugintrain.strategies.hybrid"),
        ("plugintrain.strategies.hybrid", "plugintrain.strategies.zero"),
    ],
)
def test_engine_faces_do_not_import_each_other(module: str, forbidden: str) -> None:
    assert forbidden not in _imports(module, _trees()[module])


# plugintrain.data's three rooms: what each may import of the other two.
DATA_ROOMS: dict[str, set[str]] = {
    "plugintrain.data.tokenizers": set(),
    "plugintrain.data.prepare": {"plugintrain.data.tokenizers"},
    "plugintrain.data.datamodules": {"plugintrain.data.tokenizers"},
}


def _room(module: str) -> str | None:
    return next((room for room in DATA_ROOMS if module.startswith(f"{room}.")), None)


def _room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one room of ``plugintrain.data`` into a room it may not import."""
    return [
        f"{module} -> {target}"
        for module, imported in sorted(graph.items())
        if (room := _room(module)) is not None
        for target in sorted(imported)
        if (other := _room(target)) not in (None, room) and other not in DATA_ROOMS[room]
    ]


def test_the_data_rooms_stay_apart() -> None:
    assert _room_violations(_graph(_trees())) == []


def test_a_planted_import_between_data_rooms_is_found() -> None:
    planted = _plant(
        _trees(),
        "plugintrain.data.prepare.corpus",
        "def f():\n    from plugintrain.data.datamodules.resumable import ResumableSampler\n",
    )
    assert _room_violations(_graph(planted)) == [
        "plugintrain.data.prepare.corpus -> plugintrain.data.datamodules.resumable"
    ]


def _is_literal(node: ast.AST, in_call: bool = False) -> bool:
    """Whether ``node`` is data: constants, containers of data, and calls (a preset's
    constructor) whose arguments are constants; a name only outside a call (``(str,)``)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name | ast.Attribute):
        return not in_call
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand, in_call)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_is_literal(e, in_call) for e in node.elts)
    if isinstance(node, ast.Dict):
        items = [*node.keys, *node.values]
        return all(k is not None and _is_literal(k, in_call) for k in items)
    if isinstance(node, ast.Call):
        args = [*node.args, *(k.value for k in node.keywords)]
        return all(_is_literal(a, in_call=True) for a in args)
    return False


def _formatting_skips(name: str, source: str) -> list[str]:
    """Each ``# fmt: skip`` of ``source`` that does not close a data table: an assignment of
    literal data, or a preset registered from literals (the formatter would spread a table
    over many lines)."""
    tree = ast.parse(source)
    statements = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    bad = []
    for number, line in enumerate(source.splitlines(), start=1):
        if not line.rstrip().endswith("# fmt: skip"):
            continue
        ends_here = [s for s in statements if s.end_lineno == number]
        data = [
            s
            for s in ends_here
            if isinstance(s, ast.Assign | ast.AnnAssign | ast.Expr)
            and s.value
            and _is_literal(s.value)
        ]
        if not data:
            bad.append(f"{name}:{number}")
    return bad


def test_no_formatting_is_skipped_outside_data_tables() -> None:
    bad = [
        hit for name, path in MODULES.items() for hit in _formatting_skips(name, path.read_text())
    ]
    assert bad == [], "reformat these (ruff format) instead of skipping the formatter"


def test_a_planted_formatting_skip_is_found() -> None:
    source = (
        'TABLE = {"a": (str,), "b": (int, float)}  # fmt: skip\n'
        'PRESET = Config(name="x", n_layer=2)  # fmt: skip\n'
        "def f(x):\n"
        "    return g(x,\n"
        "             x)  # fmt: skip\n"
        "y = h(TABLE, PRESET)  # fmt: skip\n"
        'register(Config(name="y", moe=MoE(top_k=2)))  # fmt: skip\n'
        "register(x)  # fmt: skip\n"
    )
    assert _formatting_skips("m", source) == ["m:5", "m:6", "m:8"]
