"""The strategies plugintrain registers: name -> :class:`StrategySpec` (as
:mod:`plugintrain.model_zoo.families` is for model families).

Everything that depends on a strategy name reads it from here: Lightning's
``StrategyRegistry`` (each class's ``register_strategies`` registers its entries), the
command line's errors and ``fit --help``, ``plugintrain estimate`` (its choices, its
``--help``, dry runs) and ``plugintrain gpu-check``. The module is plain data: it imports
neither torch nor Lightning (``estimate --help`` reads it), and a class is imported only
when :meth:`StrategySpec.load` asks for it. A new strategy name is one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_ZERO = "plugintrain.strategies.zero.ZeroStrategy"
_HYBRID = "plugintrain.strategies.hybrid.HybridParallelStrategy"


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name, and what each reader of it needs."""

    name: str
    """The short name: ``Trainer(strategy=name)``, ``trainer.strategy: name`` in a recipe."""
    class_path: str
    """The class the name builds, ``module.Class`` (imported by :meth:`load` only)."""
    description: str
    """One line, for help texts, errors and Lightning's registry."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The class's arguments the name fixes (Lightning's ``init_params``): ``zero1`` builds
    ``ZeroStrategy(stage=1)``; a recipe's ``init_args`` add the rest."""
    engine_stage: int | str | None = None
    """The gradient engine's ZeRO stage the name fixes: a strategy of data parallelism only
    (``ZeroStrategy``'s ``stage``); None for a hybrid one, whose ``zero_stage`` option
    decides it over dp x tp (+ sp) x pp x ep."""
    estimated: bool = True
    """Whether ``plugintrain estimate`` (its layouts, dry runs and ``--config`` recipes)
    models the strategy under this name."""
    one_process: Mapping[str, Any] | None = field(default_factory=dict)
    """The options, over :attr:`options`, that run it in one process at world size 1 (what
    ``plugintrain gpu-check`` compares with a CPU run); None: gpu-check leaves it out."""

    @property
    def data_parallel_only(self) -> bool:
        """Whether the strategy is data parallelism only (no tp, pp or ep)."""
        return self.engine_stage is not None

    def load(self) -> type:
        """The strategy class (importing it registers its names with Lightning)."""
        module, _, name = self.class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _zero(name: str, stage: int | str, description: str, **more: Any) -> StrategySpec:
    """A name of ``ZeroStrategy``: data parallelism over the gradient engine at ``stage``."""
    return StrategySpec(name, _ZERO, description, {"stage": stage}, engine_stage=stage, **more)


STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        _zero("ddp_bucketed", 0, "bucketed, overlapped all-reduce data parallelism"),
        _zero("zero1", 1, "ZeRO stage 1: optimizer state sharded over data-parallel ranks"),
        _zero("zero2", 2, "ZeRO stage 2: optimizer state and gradients sharded"),
        _zero(
            "parameter_server",
            "parameter_server",
            "gradients reduced to rank 0, which steps",
            estimated=False,  # rank 0's optimizer state: not modelled yet
            one_process=None,
        ),
        StrategySpec("hybrid", _HYBRID, "pp x tp (+ sp) x dp with ZeRO, on a DeviceMesh"),
        StrategySpec(
            "pipeline",
            _HYBRID,
            "GPipe / 1F1B / interleaved pipeline parallelism x data parallelism",
            {"pipeline_parallel": 2},
            estimated=False,  # estimated as `hybrid` with pp > 1
            one_process={"pipeline_parallel": 1},
        ),
    )
}
"""plugintrain's strategy names, in registration order (help texts, errors)."""

STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)
"""The names of :data:`STRATEGIES`, in order."""


def specs_of(cls: type) -> list[StrategySpec]:
    """The entries that build ``cls`` (what its ``register_strategies`` registers)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    return [spec for spec in STRATEGIES.values() if spec.class_path == path]


def register_names(cls: type, strategy_registry: Any) -> None:
    """Register the names of :data:`STRATEGIES` that build ``cls`` (its
    ``register_strategies``), each with its description and options."""
    for spec in specs_of(cls):
        strategy_registry.register(spec.name, cls, description=spec.description, **spec.options)


def register() -> None:
    """Register every name of :data:`STRATEGIES` with Lightning's ``StrategyRegistry``
    (idempotent): importing each class registers its names, as Lightning's own do."""
    for spec in STRATEGIES.values():
        spec.load()
