"""Lightning strategies for plugintrain (installed as plugintrain.strategies).

:func:`register` puts the short names ``ddp_bucketed``, ``zero1``, ``zero2``,
``parameter_server``, ``hybrid`` and ``pipeline`` (:data:`STRATEGY_NAMES`) into Lightning's
``StrategyRegistry``, so ``Trainer(strategy="zero2")`` and ``trainer.strategy: zero2`` in a
recipe work; the ``plugintrain`` command line calls it, and importing a strategy class does
it too (each registers its own names, as Lightning's do). Every name below is imported
from its module on first use (PEP 562): the plain parts (``ParallelDims``, schedules,
``PipelineOptions``) load without Lightning, for the commands that train nothing.
"""

import importlib
from typing import Any

STRATEGY_NAMES: tuple[str, ...] = (
    "ddp_bucketed",
    "zero1",
    "zero2",
    "parameter_server",
    "hybrid",
    "pipeline",
)
"""plugintrain's registered strategy names, in registration order (help texts, errors)."""

_HOME = {
    "BlockOptions": "blocks",
    "ELEMENTWISE_OPTIMIZERS": "optimizer_shards",
    "GradientEngine": "grad_engine",
    "HybridParallelStrategy": "hybrid",
    "PARAMETER_SERVER": "buckets",
    "ParallelDims": "mesh",
    "ParameterServerStrategy": "zero",
    "PipelineExecutor": "pipeline_executor",
    "PipelineOptions": "pipeline_stages",
    "PipelineStrategy": "hybrid",
    "RECOMPUTE_MODES": "blocks",
    "SCHEDULES": "pipeline_schedules",
    "STAGES": "buckets",
    "Schedule": "pipeline_schedules",
    "Stage": "buckets",
    "VirtualStage": "pipeline_stages",
    "ZeroStrategy": "zero",
    "apply_tensor_parallel": "tensor_parallel",
    "build_engine": "parallel_plan",
    "build_schedule": "pipeline_schedules",
    "check_shardable": "optimizer_shards",
    "data_parallel_mesh": "mesh",
    "expert_reduce_groups": "expert_parallel",
    "hybrid_gradient_layout": "parallel_plan",
    "optimizer_state_bytes": "optimizer_shards",
    "parallelize": "parallel_plan",
    "parallelize_experts": "expert_parallel",
    "register_elementwise_optimizer": "optimizer_shards",
    "shard_model": "parallel_plan",
    "simulate": "pipeline_schedules",
    "split_model": "pipeline_stages",
    "vocab_parallel_loss": "tensor_parallel",
}

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
    "register",
    "register_elementwise_optimizer",
    "shard_model",
    "simulate",
    "split_model",
    "vocab_parallel_loss",
]


def register() -> None:
    """Register :data:`STRATEGY_NAMES` with Lightning's ``StrategyRegistry`` (idempotent)."""
    importlib.import_module(f"{__name__}.zero")
    importlib.import_module(f"{__name__}.hybrid")


def __getattr__(name: str) -> Any:
    """Each public name from its module, imported when first asked for."""
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
