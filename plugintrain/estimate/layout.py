"""A training layout as the strategies hold it: their own option objects, validated by them.

:class:`Layout` holds a :class:`~plugintrain.strategies.ParallelDims`, a
:class:`~plugintrain.strategies.PipelineOptions`, a
:class:`~plugintrain.strategies.BlockOptions` and a LoRA spec, so every rule a launch would
enforce (degrees that divide, a schedule that can run them, recomputation modes, FSDP2
with a pipeline) is the strategies' own check, not a second copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plugintrain.estimate.names import ENGINE_STAGE, PRECISIONS, STRATEGIES
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.lora import LoRASpec
from plugintrain.strategies.blocks import BlockOptions
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_stages import PipelineOptions, check_layers

_DEGREE_FIELDS = {
    "dp": "data_parallel",
    "tp": "tensor_parallel",
    "sp": "sequence_parallel",
    "pp": "pipeline_parallel",
    "vpp": "virtual_pipeline_parallel",
    "ep": "expert_parallel",
    "cp": "context_parallel",
    "zero_stage": "zero_stage",
}
"""The command line's name of each degree -> its :class:`ParallelDims` field."""


def _one_device() -> ParallelDims:
    return ParallelDims(world_size=1)


@dataclass(frozen=True)
class Layout:
    """A training layout: a strategy name and the options its strategy would be built with.

    Build one from the command line's names with :meth:`of`; :meth:`check` validates it
    against a model.
    """

    strategy: str = "hybrid"
    """One of :data:`STRATEGIES`."""
    dims: ParallelDims = field(default_factory=_one_device)
    """The degrees over ``dp x cp x tp x pp`` ranks and the ZeRO stage."""
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    """Schedule, micro-batches and the blocks of each virtual stage (with pp > 1)."""
    blocks: BlockOptions = field(default_factory=BlockOptions)
    """Activation recomputation."""
    lora: LoRASpec | None = None
    """The LoRA adapters (the LoRA callback's spec, its ``quantize`` too: QLoRA); None:
    every parameter trains."""
    precision: str = "32-true"
    """One of :data:`PRECISIONS`."""
    micro_batch: int = 1
    """Sequences per micro-batch on one rank (the per-rank batch when pp = 1)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    bucket_size_mb: float = 25.0
    """The gradient engine's bucket size."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        sizes = {"micro_batch": self.micro_batch, "seq_len": self.seq_len}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or v < 1}
        if bad or not self.bucket_size_mb > 0:
            raise ValueError(f"these must be positive: {bad or {'bucket_size_mb': 0}}")
        if self.dims.world_size is None:
            raise ValueError("a Layout's ParallelDims needs its world_size")
        dims = self.dims
        if self.strategy == "single" and dims.world_size > 1:
            raise ValueError(
                f"strategy='single' runs on one device, got dp={dims.dp} x tp={dims.tp} x"
                f" pp={dims.pp}; use strategy 'hybrid' (or zero1/zero2 for data parallelism)"
            )
        if self.strategy in ENGINE_STAGE and (dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
            raise ValueError(
                f"strategy={self.strategy!r} is data parallelism only, got tp={dims.tp},"
                f" pp={dims.pp}, cp={dims.cp}; use strategy 'hybrid' with zero_stage"
                f" {ENGINE_STAGE[self.strategy]}"
            )

    @classmethod
    def of(
        cls,
        strategy: str = "hybrid",
        *,
        dp: int = 1,
        tp: int = 1,
        sp: bool = False,
        pp: int = 1,
        vpp: int = 1,
        ep: int = 1,
        cp: int = 1,
        zero_stage: int = 0,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
        recompute: str = "none",
        every_n_layers: int = 1,
        lora_r: int = 0,
        lora_targets: Sequence[str] | None = None,
        lora_quantize: str | None = None,
        **sizes: Any,
    ) -> Layout:
        """The layout ``plugintrain estimate``'s options (and the strategies' arguments)
        name: the degrees into :class:`ParallelDims` (ZeRO stage from the strategy name),
        the pipeline's into :class:`PipelineOptions`, recomputation into
        :class:`BlockOptions`, ``lora_r > 0`` into a :class:`LoRASpec` (the LoRA callback's
        default targets unless ``lora_targets``; its frozen base held as ``lora_quantize``
        says: QLoRA); ``sizes``: the other fields."""
        stage = ENGINE_STAGE.get(strategy, zero_stage if strategy == "hybrid" else 0)
        dims = ParallelDims(
            world_size=dp * cp * tp * pp,
            data_parallel=dp,
            tensor_parallel=tp,
            sequence_parallel=sp,
            pipeline_parallel=pp,
            virtual_pipeline_parallel=vpp,
            expert_parallel=ep,
            context_parallel=cp,
            zero_stage=stage,
        )
        counts = None if layers_per_stage is None else list(layers_per_stage)
        targets = {} if lora_targets is None else {"target_modules": tuple(lora_targets)}
        if lora_r < 0:
            raise ValueError(f"these must be positive: {{'lora_r': {lora_r}}}")
        if lora_quantize is not None and not lora_r:
            raise ValueError(
                f"lora_quantize={lora_quantize!r} quantizes LoRA's frozen base; give lora_r"
                " (e.g. --lora_r 16) or leave lora_quantize out"
            )
        quantize = {} if lora_quantize is None else {"quantize": lora_quantize}
        return cls(
            strategy=strategy,
            dims=dims,
            pipeline=PipelineOptions.resolve(dims, schedule, microbatches, counts),
            blocks=BlockOptions(recompute, every_n_layers, strategy_name="estimate"),
            lora=LoRASpec(r=lora_r, **targets, **quantize) if lora_r else None,
            **sizes,
        )

    def replace(self, **degrees: Any) -> Layout:
        """This layout with other degrees (``dp``, ``tp``, ``sp``, ``pp``, ``vpp``, ``ep``,
        ``cp``, ``zero_stage``), the pipeline's schedule and micro-batches the defaults for
        them."""
        changes = {_DEGREE_FIELDS[key]: value for key, value in degrees.items()}
        dims = dataclasses.replace(self.dims, world_size=None, **changes)
        dims = dims.with_world_size(dims.data_parallel * dims.cp * dims.tp * dims.pp)
        counts = self.pipeline.layers_per_stage
        pipeline = PipelineOptions.resolve(dims, layers_per_stage=counts)
        return dataclasses.replace(self, dims=dims, pipeline=pipeline)

    @property
    def world_size(self) -> int:
        """Ranks: dp x cp x tp x pp."""
        return self.dims.world_size

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """The global rank at mesh coordinates ``(pp, dp, cp, tp)`` (tp innermost; with
        experts, ``dp = edp x ep`` flattened the same way)."""
        dims = self.dims
        return ((pp_rank * dims.dp + dp_rank) * dims.cp + cp_rank) * dims.tp + tp_rank

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch on one rank: its rows' share under context parallelism
        (``micro_batch x seq_len / cp``; under SP, the residual stream splits them over tp
        again)."""
        return self.micro_batch * self.seq_len // self.dims.cp

    @property
    def quantize(self) -> str | None:
        """How LoRA's frozen base is held (``nf4``, ``int8``: QLoRA); None: unquantized."""
        return None if self.lora is None else self.lora.quantize

    @property
    def stage(self) -> int | None:
        """The gradient engine's ZeRO stage (3: FSDP2); None without data parallelism's
        engine (one device under Lightning's own loop)."""
        return None if self.strategy == "single" else self.dims.zero_stage

    def check(self, config: TransformerConfig) -> None:
        """Raise a one-line ``ValueError`` naming the value and the fix if ``config`` cannot
        train on this layout: the strategies' own checks, before any process would start."""
        if self.seq_len > config.block_size:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds {config.name}'s block_size="
                f"{config.block_size}; use seq_len <= {config.block_size}"
            )
        self.dims.validate_model(config, self.seq_len)
        kind = self.quantize
        if kind is not None and self.dims.tp > 1:  # the LoRA callback's own refusal
            raise ValueError(
                f"LoRA quantize: {kind} cannot run with tp={self.dims.tp}: a quantized base"
                " weight is not split over tensor-parallel ranks; use tp 1 (dp, pp or FSDP2)"
            )
        if self.dims.pp > 1:
            counts = self.pipeline.layers_per_stage
            check_layers(config.n_layer, self.dims.pp, self.dims.vpp, counts)

    def as_json(self) -> dict[str, Any]:
        """The layout in the command line's names, as plain JSON types."""
        dims, lora = self.dims, self.lora
        counts = self.pipeline.layers_per_stage
        return {
            "strategy": self.strategy,
            "dp": dims.dp,
            "tp": dims.tp,
            "sp": dims.sequence_parallel,
            "pp": dims.pp,
            "vpp": dims.vpp,
            "ep": dims.ep,
            "cp": dims.cp,
            "zero_stage": self.stage,
            "precision": self.precision,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "microbatches": self.pipeline.microbatches,
            "schedule": self.pipeline.schedule,
            "layers_per_stage": None if counts is None else list(counts),
            "recompute": self.blocks.activation_checkpointing,
            "every_n_layers": self.blocks.every_n_layers,
            "lora_r": lora.r if lora else 0,
            "lora_targets": list(lora.target_modules) if lora else None,
            "lora_quantize": self.quantize,
            "bucket_size_mb": self.bucket_size_mb,
            "world_size": self.world_size,
        }
