"""Parameters, gradients and optimizer state kept between steps, and the buffers alive only
around a reduction: exactly what the strategies keep, laid out by the gradient engine's
own :func:`~plugintrain.strategies.buckets.assign_buckets` and padding.

A rank holds every bucket's parameters and, at ZeRO 0/1, its gradients (ZeRO-2: the owned
slice, 1/dp of a bucket, or 1/(dp/ep) of an expert bucket, reduced over the ranks holding
the same experts); AdamW keeps ``exp_avg`` and ``exp_avg_sq`` in the parameters' dtype plus
a 4-byte ``step`` per tensor it steps. Without the engine (one device) each trainable
parameter has its own ``.grad``; FSDP2 (``zero_stage=3``) shards every parameter's dim 0.

With context parallelism the cp ranks of a replica hold other tokens of the same rows: their
gradients are averaged, and ZeRO / FSDP2 shard, over dp x cp (torchtitan's ``dp_shard_cp``;
expert weights over edp x cp), so a "dp rank" here is a rank of that flattened group,
``dp_rank x cp + cp_rank``.
"""

from __future__ import annotations

import math

from plugintrain.estimate.layout import Layout
from plugintrain.estimate.parameters import Local
from plugintrain.strategies.buckets import assign_buckets, padded_numel

_STEP_BYTES = 4  # AdamW's `step`: a float32 scalar tensor per parameter it steps


def training_state(held: list[Local], layout: Layout) -> list[tuple[int, int, int]]:
    """Per rank of the data-parallel group (dp x cp, :func:`shard_ranks`): bytes of
    parameters, gradients and optimizer state kept between steps."""
    frozen = sum(p.size * p.element_size() for p in held if not p.trainable)
    trainable = [p for p in held if p.trainable]
    if layout.stage is None:
        grads = sum(p.size * p.element_size() for p in trainable)
        return [(frozen + grads, grads, _adam_bytes(trainable))]
    if layout.stage == 3:
        return [_fsdp_state(held, shard_ranks(layout))] * shard_ranks(layout)
    return [(frozen + p, g, o) for p, g, o in _engine_state(trainable, layout.stage, layout)]


def _adam_bytes(params: list[Local]) -> int:
    return sum(2 * p.size * p.element_size() + _STEP_BYTES for p in params)


def _engine_state(trainable: list[Local], stage: int, layout: Layout) -> list[tuple[int, int, int]]:
    """The gradient engine's flat buckets, for each rank of the dp group.

    Every rank holds each bucket's parameters, padded to a multiple of its group's size
    (dp; for expert weights the dp / ep ranks holding the same experts); its gradients
    whole at stage 0/1 and as the owned slice at stage 2; and AdamW state for the part of
    each parameter inside its owned slice (all of it at stage 0).
    """

    params = grads = 0
    state = [0] * shard_ranks(layout)
    groups = [p.expert for p in trainable]
    for indices in assign_buckets(trainable, layout.bucket_size_mb, groups) if trainable else []:
        members = [trainable[i] for i in indices]
        size, group = members[0].element_size(), _group_size(members[0], layout)
        padded = padded_numel(sum(p.size for p in members), group)
        params += padded * size
        grads += (padded // group if stage == 2 else padded) * size
        if stage == 0:
            owned = [_adam_bytes(members)] * group
        else:
            owned = _owned_state(members, padded // group, group)
        state = [s + owned[_group_rank(rank, members[0], layout)] for rank, s in enumerate(state)]
    return [(params, grads, s) for s in state]


def shard_ranks(layout: Layout) -> int:
    """The ranks gradients are averaged and ZeRO / FSDP2 shard over: dp x cp."""
    return layout.dims.dp * layout.dims.cp


def _group_size(param: Local, layout: Layout) -> int:
    """The ranks ``param``'s gradient is reduced over: dp x cp, or dp / ep x cp for an
    expert weight."""
    dims = layout.dims
    return (dims.dp // dims.ep if param.expert else dims.dp) * dims.cp


def _group_rank(rank: int, param: Local, layout: Layout) -> int:
    """``rank`` of the dp x cp group (``dp_rank x cp + cp_rank``) as a rank of ``param``'s
    reduction group: itself, or for an expert weight its rank of edp x cp (the mesh flattens
    ``("edp", "ep")`` into dp: dp rank r is edp rank r // ep)."""
    if not param.expert:
        return rank
    cp = layout.dims.cp
    return (rank // cp // layout.dims.ep) * cp + rank % cp


def _owned_state(members: list[Local], shard: int, dp: int) -> list[int]:
    """AdamW bytes on each of ``dp`` ranks for one bucket (in the engine's packing order)
    whose ranks own ``shard`` elements each: a rank steps the part of each parameter inside
    its range, as one tensor with its own ``step``."""
    state = [0] * dp
    offset = 0
    for p in members:
        end = offset + p.size
        for rank in range(offset // shard, (end - 1) // shard + 1):
            overlap = min(end, (rank + 1) * shard) - max(offset, rank * shard)
            state[rank] += 2 * overlap * p.element_size() + _STEP_BYTES
        offset = end
    return state


def _fsdp_state(held: list[Local], dp: int) -> tuple[int, int, int]:
    """FSDP2: each parameter's dim 0 padded to a multiple of dp and split."""
    params = grads = state = 0
    for p in held:
        rows = p.shape[0] if p.shape else 1
        shard = math.ceil(rows / dp) * (p.size // max(rows, 1)) * p.element_size()
        params += shard
        if p.trainable:
            grads += shard
            state += 2 * shard + _STEP_BYTES
    return params, grads, state


def communication_bytes(held: list[Local], layout: Layout) -> int:
    """Gradient (or parameter) storage alive only around a reduction (or gather).

    ZeRO-2 frees each bucket's full gradients once reduce-scattered, but the bucket being
    reduced and the one filling exist at once; a pipeline defers every reduction to the
    end of its schedule, so there the whole local gradient exists before it is scattered.
    FSDP2 gathers a block's parameters (the next one prefetched) and reduce-scatters its
    gradients; its root unit (embeddings, head) stays gathered through the step. The root's
    bound counts every matrix held; a quantized base (QLoRA) is held as flat bytes, not
    matrices, so the two largest blocks' quantized bytes, whole, are added (the block
    running and the one prefetched).
    """

    trainable = [p for p in held if p.trainable]
    if layout.stage not in (2, 3) or not trainable:
        return 0
    if layout.stage == 3:
        root = sum(p.size * p.element_size() for p in held if len(p.shape) == 2)
        return root + sum(_quantized_blocks(held)[-2:])  # an upper bound, as said above
    groups = [p.expert for p in trainable]
    sizes = sorted(
        padded_numel(
            sum(trainable[i].size for i in indices), _group_size(trainable[indices[0]], layout)
        )
        * trainable[indices[0]].element_size()
        for indices in assign_buckets(trainable, layout.bucket_size_mb, groups)
    )
    return sum(sizes) if layout.dims.pp > 1 else sum(sizes[-2:])


def _quantized_blocks(held: list[Local]) -> list[int]:
    """Each block's quantized (non-floating) bytes, whole, ascending."""
    blocks: dict[int | None, int] = {}
    for p in held:
        if not p.dtype.is_floating_point:
            blocks[p.block] = blocks.get(p.block, 0) + p.size * p.element_size()
    return sorted(blocks.values())
