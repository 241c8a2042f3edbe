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
    cycle = _cycle(_graph(planted))
    assert cycle is not None and cycle[0] == cycle[-1]
    # The same circle, from whichever of its modules the search entered it by.
    start = cycle.index("plugintrain.core.tensor_boxes")
    assert [*cycle[start:-1], *cycle[:start], cycle[start]] == [
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


# A strategy name is declared once, in the registry; everything else reads it from there.
STRATEGY_REGISTRY = "plugintrain.strategies.registry"


def _strategy_names() -> set[str]:
    """The registered names (the registry is plain data: importing it loads no torch)."""
    from plugintrain.strategies.registry import STRATEGY_NAMES

    return set(STRATEGY_NAMES)


def _elif_tests(node: ast.If) -> list[ast.expr]:
    """The tests of an ``if``/``elif`` chain, from ``node`` down."""
    tests = [node.test]
    while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        node = node.orelse[0]
        tests.append(node.test)
    return tests


def _strategy_name_lists(name: str, tree: ast.AST, names: set[str]) -> list[str]:
    """Each place outside the registry that spells out two or more strategy names: a
    tuple, list, set or dict literal holding them (a table's rows included), a boolean
    chain of comparisons (``s == "zero1" or s == "zero2"``) or an ``if``/``elif`` chain
    testing them. One name alone (``strategy == "hybrid"``) is a use, not a list."""
    if name == STRATEGY_REGISTRY:
        return []
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        parts: list[ast.AST] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict | ast.BoolOp):
            parts = [node]
        elif isinstance(node, ast.If):
            parts = list(_elif_tests(node))
        spelled = {
            n.value
            for part in parts
            for n in ast.walk(part)
            if isinstance(n, ast.Constant) and n.value in names
        }
        if len(spelled) > 1:
            found.append(f"{name}:{node.lineno}")
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_strategy_names_are_written_only_in_the_registry() -> None:
    names = _strategy_names()
    bad = [
        hit for name, tree in _trees().items() for hit in _strategy_name_lists(name, tree, names)
    ]
    assert bad == [], f"read these from {STRATEGY_REGISTRY} instead of listing them"


def test_a_planted_second_strategy_list_is_found() -> None:
    names = _strategy_names()
    module = "plugintrain.bench.gpu_checks"
    source = (
        'STRATEGIES = ("ddp_bucketed", "zero1")\n'
        "ENTRIES = ((\"zero1\", 1), ('zero2', 2))\n"
        "def one_process(s):\n"
        '    return s == "zero2" or s != "hybrid"\n'
        "def chosen(s):\n"
        '    if s == "pipeline":\n'
        "        return 1\n"
        '    elif s == "hybrid":\n'
        "        return 2\n"
        '    return s == "hybrid"\n'
    )
    trees = _trees()
    planted = _plant(trees, module, source)
    assert _strategy_name_lists(module, trees[module], names) == []
    assert _strategy_name_lists(module, planted[module], names) == [
        f"{module}:1",
        f"{module}:2",
        f"{module}:4",
        f"{module}:6",
    ]
    # The registry itself is where they are written.
    registry = _plant(trees, STRATEGY_REGISTRY, source)[STRATEGY_REGISTRY]
    assert _strategy_name_lists(STRATEGY_REGISTRY, registry, names) == []


# A weight format is declared once, in its registry; everything else reads it from there.
FORMAT_REGISTRY = "plugintrain.formats.registry"


def _format_names() -> set[str]:
    """The registered format names (the registry imports nothing heavy)."""
    from plugintrain.formats.registry import FORMATS

    return set(FORMATS)


def _format_switches(name: str, tree: ast.AST, names: set[str]) -> list[str]:
    """Each place outside the format registry that spells out two or more format names (a
    switch on the format: ``fmt in ("hf", "llmc")``, an ``if``/``elif`` chain, a dict of
    readers): the same finder as for strategy names, with the format registry as home."""
    return [] if name == FORMAT_REGISTRY else _strategy_name_lists(name, tree, names)


def test_formats_are_switched_on_only_in_the_registry() -> None:
    names = _format_names()
    bad = [hit for name, tree in _trees().items() for hit in _format_switches(name, tree, names)]
    assert bad == [], f"read these from {FORMAT_REGISTRY} (FormatSpec) instead of listing them"


def test_a_planted_format_switch_is_found() -> None:
    names = _format_names()
    module = "plugintrain.formats.sources"
    source = (
        "def reader(kind, path):\n"
        '    if kind == "hf":\n'
        "        return 1\n"
        '    elif kind == "gguf":\n'
        "        return 2\n"
        'READERS = {"llmc": 1, "checkpoint": 2}\n'
        "def writes_files(fmt):\n"
        '    return fmt in ("llmc", "gguf") and fmt != "peft"\n'
        "def own(kind):\n"
        '    return kind == "checkpoint"\n'
    )
    trees = _trees()
    planted = _plant(trees, module, source)
    assert _format_switches(module, trees[module], names) == []
    assert _format_switches(module, planted[module], names) == [
        f"{module}:2",
        f"{module}:6",
        f"{module}:8",
    ]
    registry = _plant(trees, FORMAT_REGISTRY, source)[FORMAT_REGISTRY]
    assert _format_switches(FORMAT_REGISTRY, registry, names) == []


def _family_names() -> set[str]:
    """Every family's name, as its module's ``FamilySpec(name=...)`` spells it."""
    return {
        keyword.value.value
        for name, tree in _trees().items()
        if name.startswith("plugintrain.model_zoo.")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FamilySpec"
        for keyword in node.keywords
        if keyword.arg == "name" and isinstance(keyword.value, ast.Constant)
    }


def _family_branches(name: str, tree: ast.AST, families: set[str]) -> list[str]:
    """Each comparison of ``name`` (a formats module) with a family name literal
    (``config.family == "gpt2"``, ``arch in ("gpt2",)``): what differs by family is a
    ``FamilySpec`` field."""
    if not name.startswith("plugintrain.formats."):
        return []
    return [
        f"{name}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value in families for c in ast.walk(node))
    ]


def test_formats_read_family_differences_from_the_family_spec() -> None:
    families = _family_names()
    assert {"gpt2", "llama3", "qwen3"} <= families
    bad = [hit for name, tree in _trees().items() for hit in _family_branches(name, tree, families)]
    assert bad == [], "add a FamilySpec field (model_zoo/family_spec.py) and read it instead"


def test_a_planted_family_branch_is_found() -> None:
    families = _family_names()
    module = "plugintrain.formats.peft_adapters"
    source = (
        "def conv1d(config):\n"
        '    return config.family == "gpt2"\n'
        "def rope(arch):\n"
        '    return arch in ("llama3", "qwen3")\n'
        'NAMES = {"gpt2": 1}\n'
    )
    trees = _trees()
    assert _family_branches(module, trees[module], families) == []
    planted = _plant(trees, module, source)[module]
    assert _family_branches(module, planted, families) == [f"{module}:2", f"{module}:4"]
    # Outside the formats package a family's own module may name itself.
    model = "plugintrain.model_zoo.gpt2"
    assert _family_branches(model, _plant(trees, model, source)[model], families) == []


# Lightning's privates are reached only through the seam (issue 43, part 6).
LIGHTNING_SEAM = "plugintrain.core.lightning_seam"
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")
# Names under which the library holds Lightning objects: a private attribute read or
# written through one of them (`trainer._logger_connector`, `self.lightning_module._x`)
# belongs in the seam.
LIGHTNING_OBJECTS = {
    "trainer",
    "pl_module",
    "lightning_module",
    "fit_loop",
    "epoch_loop",
    "strategy",
    "precision_plugin",
    "checkpoint_callback",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _private_lightning_imports(name: str, tree: ast.AST) -> list[str]:
    """Each import of a private Lightning name or module outside the seam."""
    if name == LIGHTNING_SEAM:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # The module's path and the names taken from it.
            paths = [[*node.module.split("."), alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            paths = [alias.name.split(".") for alias in node.names]
        else:
            continue
        if any(p[0] in LIGHTNING_PACKAGES and any(map(_private, p)) for p in paths):
            found.append(f"{name}: {ast.unparse(node)}")
    return found


def _chain(node: ast.expr) -> list[str]:
    """The names an attribute chain goes through: ``a.b().c[0]`` -> a, b, c."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call | ast.Subscript):
            node = node.func if isinstance(node, ast.Call) else node.value
        elif isinstance(node, ast.Name):
            return [node.id, *reversed(names)]
        else:
            return list(reversed(names))


def _private_lightning_attributes(name: str, tree: ast.AST) -> list[str]:
    """Each private attribute reached through a Lightning object outside the seam."""
    if name == LIGHTNING_SEAM:
        return []
    return [
        f"{name}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _private(node.attr)
        and LIGHTNING_OBJECTS & set(_chain(node.value))
    ]


def _declared_overrides(trees: dict[str, ast.Module]) -> set[str]:
    """The project methods the seam's ``OVERRIDDEN`` names (read from its source)."""
    for node in trees[LIGHTNING_SEAM].body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and "OVERRIDDEN" in ast.unparse(node):
            return {
                n.value
                for n in ast.walk(node)
                if isinstance(n, ast.Constant) and str(n.value).startswith("plugintrain.")
            }
    return set()


def _undeclared_private_overrides(name: str, tree: ast.AST, declared: set[str]) -> list[str]:
    """Each private method marked ``@override`` (a hook of a Lightning or torch base
    class) that the seam's ``OVERRIDDEN`` does not name."""
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or not _private(method.name):
                continue
            marked = any(ast.unparse(d).endswith("override") for d in method.decorator_list)
            qualified = f"{name}.{cls.name}.{method.name}"
            if marked and qualified not in declared:
                found.append(qualified)
    return found


def test_no_private_lightning_name_is_imported_outside_the_seam() -> None:
    bad = [hit for name, tree in _trees().items() for hit in _private_lightning_imports(name, tree)]
    assert bad == [], f"import these through {LIGHTNING_SEAM}"


def test_no_private_attribute_of_a_lightning_object_is_used_outside_the_seam() -> None:
    trees = _trees()
    bad = [hit for name, tree in trees.items() for hit in _private_lightning_attributes(name, tree)]
    assert bad == [], f"reach these through a function of {LIGHTNING_SEAM}"


def test_every_overridden_private_hook_is_declared_in_the_seam() -> None:
    trees = _trees()
    declared = _declared_overrides(trees)
    assert len(declared) >= 9  # the reader above still finds the table
    bad = [
        hit
        for name, tree in trees.items()
        for hit in _undeclared_private_overrides(name, tree, declared)
    ]
    assert bad == [], f"name these in {LIGHTNING_SEAM}.OVERRIDDEN"


def test_a_planted_private_lightning_import_is_found() -> None:
    module = "plugintrain.callbacks.display"
    source = (
        "from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype\n"
        "def f():\n"
        "    import lightning.fabric.utilities._private\n"
        "    from lightning_fabric.strategies.launchers._x import Launcher\n"
        "    from lightning.pytorch import Trainer\n"
    )
    trees = _trees()
    planted = _plant(trees, module, source)
    assert _private_lightning_imports(module, trees[module]) == []
    assert _private_lightning_imports(module, planted[module]) == [
        f"{module}: from lightning.pytorch.callbacks.throughput_monitor"
        " import _plugin_to_compute_dtype",
        f"{module}: import lightning.fabric.utilities._private",
        f"{module}: from lightning_fabric.strategies.launchers._x import Launcher",
    ]
    seam = _plant(trees, LIGHTNING_SEAM, source)[LIGHTNING_SEAM]
    assert _private_lightning_imports(LIGHTNING_SEAM, seam) == []


def test_a_planted_private_attribute_of_a_lightning_object_is_found() -> None:
    module = "strategies.hybrid"
    name = f"plugintrain.{module}"
    source = (
        "def f(self, trainer):\n"
        "    self.lightning_module._device_mesh = None\n"
        "    trainer.fit_loop._should_accumulate()\n"
        "    self._binding.bound\n"
        "    trainer.strategy.root_device\n"
    )
    trees = _trees()
    planted = _plant(trees, name, source)
    assert _private_lightning_attributes(name, trees[name]) == []
    assert _private_lightning_attributes(name, planted[name]) == [
        f"{name}: self.lightning_module._device_mesh",
        f"{name}: trainer.fit_loop._should_accumulate",
    ]


def test_a_planted_undeclared_private_override_is_found() -> None:
    name = "plugintrain.precision_plugins.mixed"
    source = (
        "class Late(Precision):\n"
        "    @override\n"
        "    def _after_closure(self, model, optimizer):\n"
        "        pass\n"
        "    def _helper(self):\n"
        "        pass\n"
    )
    trees = _trees()
    declared = _declared_overrides(trees)
    planted = _plant(trees, name, source)
    assert _undeclared_private_overrides(name, trees[name], declared) == []
    assert _undeclared_private_overrides(name, planted[name], declared) == [
        f"{name}.Late._after_closure"
    ]
