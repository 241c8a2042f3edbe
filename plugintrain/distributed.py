"""Small protocols shared by strategies, precision plugins and models.

Strategies know how a model is laid out across ranks; precision plugins need that
knowledge to agree on found-inf and to clip by the global gradient norm. Neither imports
the other: a strategy exposes a :class:`GradientLayout` through the
:class:`GradientLayoutProvider` protocol, and a plugin asks for one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class GradientPiece:
    """This rank's piece of one parameter's gradient.

    Attributes:
        grad: The local gradient tensor (a DTensor's local shard, never a DTensor).
        replicas: How many ranks of the layout's group hold an identical copy of ``grad``;
            each contributes ``1 / replicas`` of its squared norm, so every parameter
            counts exactly once in the global norm.
    """

    grad: Tensor
    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"`replicas` must be >= 1, got {self.replicas}.")


@dataclass(frozen=True)
class GradientLayout:
    """Where a model's gradients live across ranks.

    Attributes:
        group: The process group spanning every rank that holds part of the model (tensor,
            pipeline and data-parallel shards); ``None`` when this process holds it all.
        pieces: This rank's gradient pieces.
        device: Device of the reduction buffers (the group's communication device).
    """

    group: dist.ProcessGroup | None
    pieces: list[GradientPiece]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def grads(self) -> list[Tensor]:
        """The local gradient tensors, for in-place scaling."""
        return [piece.grad for piece in self.pieces]

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
        """All-reduce ``tensor`` in place over the group (a no-op without one)."""
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def global_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient, identical on every rank of the group."""
        squared = torch.zeros((), dtype=torch.float32, device=self.device)
        for piece in self.pieces:
            # fp32 accumulation: bf16 grads (bf16-true) would lose the small terms.
            norm = torch.linalg.vector_norm(piece.grad, dtype=torch.float32)
            squared += norm.square() / piece.replicas
        return self.all_reduce(squared, dist.ReduceOp.SUM).sqrt()


@runtime_checkable
class GradientLayoutProvider(Protocol):
    """What a strategy implements to tell precision plugins how gradients are laid out."""

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """The layout of the gradients of ``parameters`` (those an optimizer steps)."""
        ...


def _world_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _distinct_shards(tensor: DTensor) -> int:
    """Number of different local pieces a DTensor is split into across its mesh."""
    placements = tensor.placements
    if any(placement.is_partial() for placement in placements):
        raise ValueError(f"Gradient has pending Partial placements {placements}; reduce it first.")
    mesh = tensor.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(placements) if _splits(p))


def _splits(placement: Placement) -> bool:
    # FSDP2 over a tensor-parallel dim shards with `_StridedShard`, which `is_shard()`
    # does not report (torch 2.13): it still splits the tensor across that mesh dim.
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _pieces(parameters: Iterable[Tensor], world_size: int) -> Iterator[GradientPiece]:
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            yield GradientPiece(grad.to_local(), world_size // _distinct_shards(grad))
        else:
            yield GradientPiece(grad, world_size)


def default_gradient_layout(parameters: Iterable[Tensor]) -> GradientLayout:
    """The layout of a model that every rank holds whole, possibly as DTensor shards.

    Right for one process, DDP (every gradient replicated world-size times) and DTensor
    tensor/FSDP sharding over the whole world (a DTensor's piece is replicated
    ``world_size / shards`` times). Not right for pipeline stages, which hold different
    parameters: a pipeline strategy must provide its own layout.

    Args:
        parameters: The parameters whose gradients the layout describes.
    """
    group = _world_group()
    world_size = dist.get_world_size(group) if group is not None else 1
    pieces = list(_pieces(parameters, world_size))
    device = pieces[0].grad.device if pieces else torch.device("cpu")
    return GradientLayout(group=group, pieces=pieces, device=device)
