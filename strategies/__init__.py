"""Lightning strategies for plugintrain (installed as plugintrain.strategies).

Importing the package registers the short names ``ddp_bucketed``, ``zero1``, ``zero2``
and ``parameter_server`` with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="zero2")`` and ``trainer.strategy: zero2`` in a recipe work.
"""

from lightning.pytorch.strategies import StrategyRegistry

from plugintrain.strategies.grad_engine import (
    ELEMENTWISE_OPTIMIZERS,
    PARAMETER_SERVER,
    STAGES,
    GradientEngine,
    Stage,
    check_shardable,
    optimizer_state_bytes,
    register_elementwise_optimizer,
)
from plugintrain.strategies.zero import ParameterServerStrategy, ZeroStrategy

for _strategy in (ZeroStrategy, ParameterServerStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "PARAMETER_SERVER",
    "STAGES",
    "GradientEngine",
    "ParameterServerStrategy",
    "Stage",
    "ZeroStrategy",
    "check_shardable",
    "optimizer_state_bytes",
    "register_elementwise_optimizer",
]
