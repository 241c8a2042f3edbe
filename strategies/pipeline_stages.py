"""Pipeline stages: cutting a model into the virtual stages a pipeline rank runs.

:func:`split_model` cuts any :class:`~plugintrain.core.contracts.StagedModel` (the zoo's
``Transformer``, or a new family that implements the protocol) into this rank's virtual
stages in place (torchtitan's layout: the ``layers`` ``ModuleDict`` keeps the full-model
keys of the layers it still holds, and the embedding and head are dropped on the ranks
that do not run the first or last stage), so parameter names, tensor-parallel plans and
checkpoints keep their full-model paths. :class:`PipelineOptions` groups how a pipeline
runs (schedule, micro-batches, uneven stages, wire dtype); the executor that runs the
stages is :mod:`~plugintrain.strategies.pipeline_executor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from plugintrain.core.contracts import StagedModel
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_schedules import validate as validate_schedule

AUTO = "auto"
"""``layers_per_stage: auto``: the split is measured and chosen at setup."""


def check_layers(
    n_layer: int, pp: int, vpp: int, layers_per_stage: Sequence[int] | str | None = None
) -> None:
    """Raise a ``ValueError`` naming the fix unless ``n_layer`` splits into ``pp * vpp`` chunks.

    Args:
        n_layer: Transformer blocks of the model.
        pp: Pipeline ranks.
        vpp: Chunks per rank.
        layers_per_stage: Blocks of each virtual stage, in stage order; None: equal;
            ``"auto"``: chosen from measured costs (at least one block per stage).
    """
    stages = pp * vpp
    layers = _layer_counts(layers_per_stage)
    if layers == AUTO:
        if n_layer < stages:
            raise ValueError(
                f"layers_per_stage=auto needs a block per stage: n_layer={n_layer} <"
                f" pipeline_parallel={pp} x virtual_pipeline_parallel={vpp}; use fewer stages"
            )
        return
    if layers is not None:
        counts = list(layers)
        if len(counts) != stages or sum(counts) != n_layer or min(counts) < 0:
            raise ValueError(
                f"layers_per_stage={counts} must list {stages} (pipeline_parallel={pp} x"
                f" virtual_pipeline_parallel={vpp}) non-negative layer counts summing to"
                f" n_layer={n_layer}."
            )
        return
    if n_layer % stages:
        divisors = [d for d in range(1, n_layer + 1) if n_layer % d == 0]
        raise ValueError(
            f"n_layer={n_layer} is not divisible by pipeline_parallel={pp} x"
            f" virtual_pipeline_parallel={vpp} = {stages} stages; pick pp x vpp among"
            f" {divisors}, or give layers_per_stage (e.g. fewer layers on the last stage,"
            " which also runs the head and the loss)."
        )


def stage_layer_keys(
    n_layer: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[list[str]]:
    """The ``layers`` keys of each virtual stage: contiguous runs, equal unless given."""
    counts = list(layers_per_stage or [n_layer // num_stages] * num_stages)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [
        [str(i) for i in range(start, start + n)] for start, n in zip(starts, counts, strict=True)
    ]


def rank_stages(rank: int, pp: int, vpp: int = 1) -> list[int]:
    """The virtual stages pipeline rank ``rank`` runs, in chunk order: its chunk ``c`` is
    stage ``c * pp + rank`` (the interleaved schedule's round-robin placement)."""
    return [c * pp + rank for c in range(vpp)]


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline runs, beside its degrees (``pipeline_parallel`` and
    ``virtual_pipeline_parallel`` are degrees of the mesh and live in ``ParallelDims``).

    Build it with :meth:`resolve`, which fills the defaults from the degrees and refuses
    a schedule that cannot run them.
    """

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved``."""
    microbatches: int = 1
    """Micro-batches each batch is cut into."""
    layers_per_stage: tuple[int, ...] | Literal["auto"] | None = None
    """Blocks of each virtual stage, in stage order; None: equal; ``"auto"``: measured
    and chosen when the strategy sets up (:mod:`~plugintrain.strategies.balance`)."""
    wire_dtype: torch.dtype | None = None
    """Dtype of the activations and gradients sent between stages; None: the training
    compute dtype (bf16 under ``bf16-mixed``/``bf16-true``, fp16 under ``16-mixed``,
    fp32 under ``32-true``), chosen by the runtime from the precision plugin."""

    @classmethod
    def resolve(
        cls,
        dims: ParallelDims,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: Sequence[int] | str | None = None,
        wire_dtype: torch.dtype | str | None = None,
    ) -> PipelineOptions:
        """Defaults from ``dims`` (``1f1b``, or ``interleaved`` with vpp > 1; ``microbatches =
        pipeline_parallel``), validated when ``dims`` has a pipeline.

        Raises:
            ValueError: On a schedule that cannot run the degrees, or an unknown dtype.
        """
        vpp = dims.virtual_pipeline_parallel
        options = cls(
            schedule=schedule or ("interleaved" if vpp > 1 else "1f1b"),
            microbatches=dims.pipeline_parallel if microbatches is None else microbatches,
            layers_per_stage=_layer_counts(layers_per_stage),
            wire_dtype=_dtype(wire_dtype),
        )
        if dims.pipeline_parallel > 1:
            validate_schedule(dims.pipeline_parallel, vpp, options.microbatches, options.schedule)
        return options


def _layer_counts(value: Sequence[int] | str | None) -> tuple[int, ...] | Literal["auto"] | None:
    """``layers_per_stage`` as a tuple of block counts, ``"auto"`` or None; any other string
    is an error."""
    if value is None or value == AUTO:
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        raise ValueError(
            f"layers_per_stage={value!r} is neither 'auto' nor a list of block counts per"
            " stage (e.g. [5, 3])"
        )
    return tuple(value)


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"wire_dtype={value!r} is not a torch dtype; use e.g. 'float32'.")
    return dtype


@dataclass
class VirtualStage:
    """One virtual stage of a split :class:`~plugintrain.core.contracts.StagedModel`: which of
    the model's blocks it runs, and whether it embeds (first) or runs the head (last).

    Not a module: the modules stay registered on the split model, under their full-model
    names, so plans and checkpoints keep their paths.
    """

    model: StagedModel
    index: int
    """The virtual stage's place in the whole pipeline (0 embeds, the last runs the head)."""
    layer_keys: list[str]
    is_first: bool
    is_last: bool

    def __call__(self, x: Tensor, seq_len: int, positions: Tensor | None = None) -> Tensor:
        """Token ids ``(B, T)`` (first stage) or hidden states in; hidden states or logits out.

        Args:
            x: The stage input.
            seq_len: The full sequence length ``T`` (hidden states may be sequence shards).
            positions: Packed rows' ``(B, T)`` positions (every stage masks attention at
                their example boundaries); None: ``0..T-1``.
        """
        if positions is None:
            positions = torch.arange(seq_len, device=x.device)
        h = self.model.embed(x, positions) if self.is_first else x
        h = self.model.run_layers(h, self.layer_keys, positions)
        return self.model.head(h) if self.is_last else h


def split_model(
    model: StagedModel,
    rank: int,
    pp: int,
    vpp: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[VirtualStage]:
    """Keep only pipeline rank ``rank``'s ``vpp`` virtual stages of ``model`` (in place).

    Virtual stage ``c * pp + rank`` is the rank's chunk ``c``. The first stage keeps the
    embeddings, the last the final norm and the head (see ``StagedModel.keep_stage``). A
    head tied to the embedding stays the same ``Parameter`` on the last stage; the
    strategy keeps the two copies equal (:mod:`plugintrain.strategies.tied`).

    Args:
        model: The full model, the same (seeded) on every rank; its ``layers`` keys are
            ``"0"`` to ``str(n_layer - 1)``.
        rank: This pipeline rank.
        pp: Pipeline ranks.
        vpp: Virtual stages per rank.
        layers_per_stage: Blocks of each virtual stage (e.g. ``[5, 3]`` to give the
            last stage, which also runs the head, fewer); None: equal runs.

    Returns:
        The rank's virtual stages, in chunk order.
    """
    n_layer = len(model.layers)
    check_layers(n_layer, pp, vpp, layers_per_stage)
    num_stages = pp * vpp
    keys = stage_layer_keys(n_layer, num_stages, layers_per_stage)
    stages = rank_stages(rank, pp, vpp)
    owned = {key for s in stages for key in keys[s]}
    model.keep_stage(owned, first=0 in stages, last=num_stages - 1 in stages)
    return [
        VirtualStage(model, s, keys[s], is_first=s == 0, is_last=s == num_stages - 1)
        for s in stages
    ]
