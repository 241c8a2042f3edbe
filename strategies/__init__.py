"""Lightning strategies for plugintrain (installed as plugintrain.strategies).

Importing the package registers the short names ``ddp_bucketed``, ``zero1``, ``zero2``,
``parameter_server``, ``hybrid`` and ``pipeline`` with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="zero2")`` and ``trainer.strategy: zero2`` in a recipe work;
:data:`STRATEGY_NAMES` lists them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from plugintrain.strategies.blocks import RECOMPUTE_MODES, BlockOptions
from plugintrain.strategies.buckets import PARAMETER_SERVER, STAGES, Stage
from plugintrain.strategies.expert_parallel import expert_reduce_groups, parallelize_experts
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.hybrid import HybridParallelStrategy, PipelineStrategy
from plugintrain.strategies.mesh import ParallelDims, data_parallel_mesh
from plugintrain.strategies.optimizer_shards import (
    ELEMENTWISE_OPTIMIZERS,
    check_shardable,
    optimizer_state_bytes,
    register_elementwise_optimizer,
)
from plugintrain.strategies.parallelize import (
    build_engine,
    hybrid_gradient_layout,
    parallelize,
    shard_model,
)
from plugintrain.strategies.pipeline_executor import PipelineExecutor
from plugintrain.strategies.pipeline_schedules import (
    SCHEDULES,
    Schedule,
    build_schedule,
    simulate,
)
from plugintrain.strategies.pipeline_stages import PipelineOptions, VirtualStage, split_model
from plugintrain.strategies.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss
from plugintrain.strategies.zero import ParameterServerStrategy, ZeroStrategy

# One class per family registers all its names, with preset arguments (as Lightning's
# DDPStrategy registers ``ddp_spawn``); the subclasses only change defaults.
_STRATEGIES = (ZeroStrategy, HybridParallelStrategy)
for _strategy in _STRATEGIES:
    _strategy.register_strategies(StrategyRegistry)

# The short names registered above, in registration order (for help texts and errors).
STRATEGY_NAMES: tuple[str, ...] = tuple(
    name for name, entry in StrategyRegistry.items() if entry["strategy"] in _STRATEGIES
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "PARAMETER_SERVER",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "STAGES",
    "STRATEGY_NAMES",
    "BlockOptions",
    "GradientEngine",
    "HybridParallelStrategy",
    "ParallelDims",
    "ParameterServerStrategy",
    "PipelineExecutor",
    "PipelineOptions",
    "PipelineStrategy",
    "Schedule",
    "Stage",
    "VirtualStage",
    "ZeroStrategy",
    "apply_tensor_parallel",
    "build_engine",
    "build_schedule",
    "check_shardable",
    "data_parallel_mesh",
    "expert_reduce_groups",
    "hybrid_gradient_layout",
    "optimizer_state_bytes",
    "parallelize",
    "parallelize_experts",
    "register_elementwise_optimizer",
    "shard_model",
    "simulate",
    "split_model",
    "vocab_parallel_loss",
]
