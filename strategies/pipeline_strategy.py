"""PipelineStrategy: pipeline parallelism (x data parallelism) under its own name.

The machinery is :class:`~plugintrain.strategies.HybridParallelStrategy`'s, which composes
pipeline, tensor and data parallelism on one DeviceMesh; this class is its pipeline-first
face, ``strategy: pipeline``, the way Lightning users pick ``ddp`` or ``fsdp`` by name. It
adds nothing but a default of two stages: every option of the hybrid strategy
(``tensor_parallel``, ``overlap_comm``, ...) is accepted and means the same.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from typing_extensions import override

from plugintrain.strategies.hybrid import HybridParallelStrategy


class PipelineStrategy(HybridParallelStrategy):
    """GPipe, 1F1B or interleaved pipeline parallelism, with data parallelism (ZeRO 0-2).

    Registered as ``pipeline``. ``devices x num_nodes`` ranks form
    ``world / pipeline_parallel`` data-parallel replicas of ``pipeline_parallel`` stages.
    See :class:`~plugintrain.strategies.HybridParallelStrategy` for the options, the
    training step, validation and checkpoints (which reload under another pipeline size).

    Args:
        pipeline_parallel: Pipeline stages (ranks per replica).
        **kwargs: Any option of :class:`~plugintrain.strategies.HybridParallelStrategy`.
    """

    strategy_name = "pipeline"

    def __init__(self, pipeline_parallel: int = 2, **kwargs: Any) -> None:
        super().__init__(pipeline_parallel=pipeline_parallel, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="GPipe / 1F1B / interleaved pipeline parallelism x data parallelism",
        )
