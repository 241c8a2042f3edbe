"""Seeded weight initialization that any rank can compute for its own shard alone.

A model built on the meta device and sharded before it is materialized (pipeline stages,
tensor-parallel shards, FSDP2 shards) must still start from the weights one process would
draw. Drawing from the global generator in module order cannot do that: a rank would
have to draw every other rank's numbers first. Here each parameter's values depend only
on ``(seed, key, position)``: the whole tensor is cut into chunks of :data:`CHUNK`
elements in flat order, chunk ``c`` is drawn by a generator seeded from
``(seed, key, c)``, and a rank generates just the chunks that overlap its shard (all of
them for a column shard, one chunk in memory at a time) and copies the overlap. One
process, any pipeline split and any tp/FSDP2 sharding therefore get the same values.

``key`` is the parameter's name in the whole model (a tied weight uses one name for
both places), ``seed`` is drawn once per model from the global generator, so
``seed_everything`` keeps runs reproducible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import Tensor

from plugintrain.core.tensor_boxes import Box, flat_boxes, intersect, local_box, select

CHUNK = 1 << 20
"""Elements drawn per generator: 4 MiB of fp32 at a time, whatever the tensor's size."""


def draw_seed() -> int:
    """A model's init seed, from the global CPU generator (same on every seeded rank)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def chunk_seed(seed: int, key: str, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of the parameter called ``key`` (a 63-bit hash:
    an 8B model's ~8,000 chunks, or a 405B model's, never share one)."""
    digest = hashlib.blake2b(f"{seed}/{key}#{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def seeded_normal_(param: Tensor, std: float, seed: int, key: str, mean: float = 0.0) -> Tensor:
    """Fill ``param`` (a tensor, or a DTensor: only its local shard is written) with
    normal(``mean``, ``std``) values that depend only on ``seed``, ``key`` and position.

    Values are drawn in fp32 by a generator on the parameter's device (CUDA draws its
    chunks there) and cast into the parameter: every layout on one device type starts from
    the same numbers, whatever the dtype.
    """
    local, box = local_box(param)
    normal_box_(local, box, tuple(param.shape), std, seed, key, mean)
    return param


@torch.no_grad()
def seeded_uniform_(param: Tensor, bound: float, seed: int, key: str) -> Tensor:
    """Fill ``param`` (a tensor, or a DTensor's local shard) with uniform(-``bound``,
    ``bound``) values that depend only on ``seed``, ``key`` and position, like
    :func:`seeded_normal_` (PyTorch's Kaiming-uniform Linear init is ``bound = 1/sqrt(in)``)."""
    local, box = local_box(param)
    _fill_box_(
        local,
        box,
        tuple(param.shape),
        seed,
        key,
        lambda v, g: v.uniform_(-bound, bound, generator=g),
    )
    return param


@torch.no_grad()
def normal_box_(
    local: Tensor,
    box: Box,
    shape: tuple[int, ...],
    std: float,
    seed: int,
    key: str,
    mean: float = 0.0,
) -> Tensor:
    """Fill ``local``, the part of a tensor of ``shape`` at ``box``, with its values of
    :func:`seeded_normal_`, drawing only the chunks that overlap ``box``."""
    return _fill_box_(local, box, shape, seed, key, lambda v, g: v.normal_(mean, std, generator=g))


def _fill_box_(
    local: Tensor,
    box: Box,
    shape: tuple[int, ...],
    seed: int,
    key: str,
    draw: Callable[[Tensor, torch.Generator], Tensor],
) -> Tensor:
    """Fill ``local`` (the part of a tensor of ``shape`` at ``box``) chunk by chunk, each
    chunk's fp32 values drawn in place by ``draw(values, generator)``."""
    if local.numel() == 0:
        return local
    first, last = _flat_extent(shape, box)
    for chunk in range(first // CHUNK, last // CHUNK + 1):
        start = chunk * CHUNK
        length = min(CHUNK, _numel(shape) - start)
        device = local.device if local.device.type == "cuda" else torch.device("cpu")
        generator = torch.Generator(device).manual_seed(chunk_seed(seed, key, chunk))
        values = draw(torch.empty(length, device=device), generator)
        position = 0
        for piece in flat_boxes(shape, start, length):
            size = _numel(piece[1])
            overlap = intersect(piece, box)
            if overlap is not None:
                drawn = values[position : position + size].view(piece[1])
                select(local, overlap, box[0]).copy_(select(drawn, overlap, piece[0]))
            position += size
    return local


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _flat_extent(shape: tuple[int, ...], box: Box) -> tuple[int, int]:
    """The first and last flat index of the whole tensor that ``box`` covers."""
    first = last = 0
    for dim, (offset, size) in enumerate(zip(*box, strict=True)):
        stride = _numel(shape[dim + 1 :])
        first += offset * stride
        last += (offset + size - 1) * stride
    return first, last
