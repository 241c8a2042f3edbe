"""Lightning strategies for plugintrain (installed as plugintrain.strategies).

:func:`register` puts the short names (``ddp_bucketed``, ``zero1``, ``zero2``,
``parameter_server``, ``hybrid``, ``pipeline``; each declared once, in
:data:`~plugintrain.strategies.registry.STRATEGIES`) into Lightning's ``StrategyRegistry``, so
``Trainer(strategy="zero2")`` and ``trainer.strategy: zero2`` in a recipe work; the
``plugintrain`` command line calls it, and importing a strategy class does it too (each
registers its own names, as Lightning's do). Every name below is imported from its module
on first use (PEP 562): the plain parts (the registry, ``ParallelDims``, schedules,
``PipelineOptions``) load without Lightning, for the commands that train nothing.
"""

from plugintrain.core.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "blocks": ("RECOMPUTE_MODES", "BlockOptions"),
        "buckets": ("PARAMETER_SERVER", "STAGES", "Stage"),
        "expert_parallel": ("expert_reduce_groups", "parallelize_experts"),
        "grad_engine": ("GradientEngine",),
        "hybrid": ("HybridParallelStrategy", "PipelineStrategy"),
        "mesh": ("ParallelDims", "data_parallel_mesh"),
        "optimizer_shards": (
            "ELEMENTWISE_OPTIMIZERS",
            "check_shardable",
            "optimizer_state_bytes",
            "register_elementwise_optimizer",
        ),
        "parallel_plan": ("build_engine", "hybrid_gradient_layout", "parallelize", "shard_model"),
        "pipeline_executor": ("PipelineExecutor",),
        "pipeline_schedules": ("SCHEDULES", "Schedule", "build_schedule", "simulate"),
        "pipeline_stages": ("PipelineOptions", "VirtualStage", "split_model"),
        "registry": ("STRATEGIES", "STRATEGY_NAMES", "StrategySpec", "register"),
        "tensor_parallel": ("apply_tensor_parallel", "vocab_parallel_loss"),
        "zero": ("ParameterServerStrategy", "ZeroStrategy"),
    },
)
