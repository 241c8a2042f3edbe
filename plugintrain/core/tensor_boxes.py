"""Boxes: where a piece of a tensor lies in the whole tensor.

A box is ``(offsets, sizes)``, one entry per dimension of the whole (row-major) tensor.
A DTensor's local shard is one box of its global tensor (:func:`local_box`); a flat range
of a tensor's elements (a ZeRO shard, a chunk of generated values) is a few boxes
(:func:`flat_boxes`). Sharded checkpoints and shard-first initialization both work on
boxes, so they agree with the whole tensor under any layout.
"""

from __future__ import annotations

import math

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape: tuple[int, ...], start: int, length: int) -> list[Box]:
    """The boxes covering elements ``[start, start + length)`` of a row-major tensor of
    ``shape`` (flattened), in flat order: each box is itself contiguous in that order.

    At most ``2 * len(shape) - 1`` boxes: a partial leading row, whole rows, a partial
    trailing row, recursively.
    """
    if length <= 0:
        return []
    if len(shape) <= 1:
        return [((start,), (length,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    end = start + length
    first, last = start // row, (end - 1) // row
    if first == last:  # inside one row: recurse into it
        inner = flat_boxes(shape[1:], start - first * row, length)
        return [((first, *offsets), (1, *sizes)) for offsets, sizes in inner]
    boxes = []
    whole_from, whole_to = -(-start // row), end // row
    if start % row:
        boxes += flat_boxes(shape, start, whole_from * row - start)
    if whole_to > whole_from:
        zeros = (0,) * (len(shape) - 1)
        boxes.append(((whole_from, *zeros), (whole_to - whole_from, *shape[1:])))
    if end % row:
        boxes += flat_boxes(shape, whole_to * row, end - whole_to * row)
    return boxes


def local_box(tensor: Tensor) -> tuple[Tensor, Box]:
    """The tensor holding ``tensor``'s data on this rank and its box in the whole tensor:
    a DTensor's local shard and where it lies; a plain tensor and the whole of it."""
    if isinstance(tensor, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tensor._local_tensor, (tuple(offsets), tuple(sizes))
    return tensor, ((0,) * tensor.dim(), tuple(tensor.shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The box where ``a`` and ``b`` overlap, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def select(tensor: Tensor, box: Box, origin: tuple[int, ...]) -> Tensor:
    """The view of ``tensor`` (whose element 0 lies at ``origin`` of the whole) covering
    ``box``."""
    index = tuple(slice(o - g, o - g + s) for o, s, g in zip(*box, origin, strict=True))
    return tensor[index]
