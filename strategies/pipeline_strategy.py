"""PipelineStrategy: pipeline parallelism (x data parallelism) under its own name.

The machinery lives in :class:`~plugintrain.strategies.HybridParallelStrategy`, which
composes pipeline, tensor and data parallelism on one DeviceMesh; this strategy is its
pipeline-first face: ``strategy: pipeline`` with pipeline options in front and no tensor
parallelism, the way Lightning users pick ``ddp`` or ``fsdp`` by name.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from plugintrain.strategies.hybrid import HybridParallelStrategy


class PipelineStrategy(HybridParallelStrategy):
    """GPipe, 1F1B or interleaved pipeline parallelism, with data parallelism (ZeRO 0-2).

    Registered as ``pipeline``. ``devices x num_nodes`` ranks form
    ``world / pipeline_parallel`` data-parallel replicas of ``pipeline_parallel`` stages.
    See :class:`~plugintrain.strategies.HybridParallelStrategy` for the training step,
    validation and checkpoints (which reload under another pipeline size).

    Args:
        pipeline_parallel: Pipeline stages (ranks per replica).
        virtual_pipeline_parallel: Model chunks per rank (needs ``schedule="interleaved"``).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``; default ``1f1b``, or
            ``interleaved`` when ``virtual_pipeline_parallel > 1``.
        microbatches: Micro-batches each batch is cut into; must divide the per-rank batch
            size (and be a multiple of ``pipeline_parallel`` for ``interleaved``); default
            ``pipeline_parallel``.
        layers_per_stage: Transformer blocks of each virtual stage, in stage order;
            default: equal. E.g. ``[5, 3]``: the last stage also runs the head and the loss.
        data_parallel: Replicas; ``"auto"``: world size / pipeline_parallel.
        zero_stage: 0 (bucketed all-reduce), 1 or 2 (ZeRO over the data-parallel ranks).
        wire_dtype: Dtype of the activations and gradients sent between stages.
        bucket_size_mb: Gradient bucket size of the data-parallel engine.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: chosen from the device.
        timeout: Timeout of the process group's collectives.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pipeline_parallel: int = 2,
        virtual_pipeline_parallel: int = 1,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: list[int] | None = None,
        data_parallel: int | Literal["auto"] = "auto",
        zero_stage: int = 0,
        wire_dtype: torch.dtype | str = torch.float32,
        bucket_size_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel=data_parallel,
            pipeline_parallel=pipeline_parallel,
            virtual_pipeline_parallel=virtual_pipeline_parallel,
            schedule=schedule,
            microbatches=microbatches,
            layers_per_stage=layers_per_stage,
            zero_stage=zero_stage,
            wire_dtype=wire_dtype,
            bucket_size_mb=bucket_size_mb,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="GPipe / 1F1B / interleaved pipeline parallelism x data parallelism",
        )
