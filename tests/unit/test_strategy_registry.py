"""The strategy registry (``plugintrain.strategies.registry``): each entry is what Lightning
registers under its name, builds its class with its options, and is read without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from plugintrain import strategies
from plugintrain.estimate.names import ENGINE_STAGE, SINGLE
from plugintrain.estimate.names import STRATEGIES as ESTIMATED
from plugintrain.strategies.registry import STRATEGIES, STRATEGY_NAMES, StrategySpec, specs_of

REPO = Path(__file__).resolve().parents[2]
strategies.register()


@pytest.mark.parametrize("spec", STRATEGIES.values(), ids=STRATEGY_NAMES)
def test_each_entry_is_registered_with_lightning_as_declared(spec: StrategySpec) -> None:
    entry = StrategyRegistry[spec.name]
    assert entry["strategy"] is spec.load()
    assert entry["init_params"] == dict(spec.options)
    assert entry["description"] == spec.description


@pytest.mark.parametrize("spec", STRATEGIES.values(), ids=STRATEGY_NAMES)
def test_each_name_builds_its_class_with_its_options(spec: StrategySpec) -> None:
    built = StrategyRegistry.get(spec.name)
    assert type(built) is spec.load()
    if spec.data_parallel_only:
        assert built.engine_stage == spec.engine_stage == spec.options["stage"]
    else:  # a hybrid strategy: its degrees as the options give them
        pp = spec.options.get("pipeline_parallel", 1)
        assert built.parallel_dims.pipeline_parallel == pp


def test_every_plugintrain_strategy_name_is_an_entry() -> None:
    """Names Lightning holds for plugintrain's classes are exactly the registry's: a class
    that registered a name of its own would show here."""
    package = "plugintrain.strategies"
    ours = [n for n, e in StrategyRegistry.items() if e["strategy"].__module__.startswith(package)]
    assert sorted(ours) == sorted(STRATEGY_NAMES)
    for cls in {spec.load() for spec in STRATEGIES.values()}:
        assert all(spec.load() is cls for spec in specs_of(cls))


def test_the_estimate_reads_its_names_from_the_registry() -> None:
    assert ESTIMATED == (SINGLE, "ddp_bucketed", "zero1", "zero2", "hybrid")
    assert ENGINE_STAGE == {"ddp_bucketed": 0, "zero1": 1, "zero2": 2}


def test_reading_the_registry_imports_neither_torch_nor_lightning() -> None:
    probe = (
        "import sys\n"
        "from plugintrain.strategies.registry import STRATEGIES\n"
        "from plugintrain.estimate.names import STRATEGIES as ESTIMATED\n"
        "assert STRATEGIES and ESTIMATED\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout.strip() == "[]"
