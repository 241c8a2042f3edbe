"""ContextShard: which part of every sequence a context-parallel rank holds, and the
all-gather that puts keys and values back in sequence order.

A row of ``T`` tokens is cut into ``2 cp`` chunks of ``L = T / 2cp``; rank ``r`` of the cp
group holds chunks ``r`` and ``2cp - 1 - r`` (one from each end), so under causal attention
every rank does the same work. The attention built on it is
:mod:`plugintrain.model_zoo.context_parallel`; the strategy hands each rank its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 over a group, the rank-major pieces concatenated; backward:
    reduce-scatter of the gradient (each rank gets the sum of its piece's gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.size(0), *x.shape[1:]))  # rank-major along dim 0
        dist.all_gather_single(out, x, group=group)
        return out.unflatten(0, (size, -1)).movedim(0, 2).flatten(2, 3)  # (B, h, size*Lx, hs)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        B, h, total, hs = grad.shape
        pieces = grad.reshape(B, h, size, total // size, hs).movedim(2, 0).flatten(0, 1)
        out = pieces.new_empty((B, h, total // size, hs))
        dist.reduce_scatter_single(out, pieces.contiguous(), group=ctx.group)
        return out, None


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of every sequence under context parallelism.

    Args:
        size: The cp degree (ranks a sequence is split over).
        rank: This rank's index in its cp group.
        group: The cp process group (None on one rank).
    """

    size: int
    rank: int
    group: dist.ProcessGroup | None = None

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunks (of ``2 size``) this rank holds: one from each end."""
        return self.rank, 2 * self.size - 1 - self.rank

    def chunk_length(self, seq_len: int) -> int:
        """Tokens per chunk for rows of ``seq_len`` (which ``2 size`` must divide)."""
        if seq_len % (2 * self.size):
            raise ValueError(
                f"sequence length {seq_len} is not divisible by 2 x context_parallel ="
                f" {2 * self.size}; pick a seq_len that is, or another context_parallel"
            )
        return seq_len // (2 * self.size)

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` along ``dim`` (the sequence), in order."""
        L = self.chunk_length(x.size(dim))
        return torch.cat([x.narrow(dim, c * L, L) for c in self.chunks], dim=dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's chunks of ``x`` ``(B, h, 2L, hs)`` put back in sequence order:
        ``(B, h, T, hs)``, differentiable (its backward reduce-scatters)."""
        if self.size == 1:
            return x
        gathered = _GatherSequence.apply(x, self.group)  # rank-major: r's (r, 2cp-1-r)
        L = x.size(2) // 2
        pieces = gathered.split(L, dim=2)  # rank r's chunks at 2r and 2r + 1
        order = [pieces[2 * r] for r in range(self.size)]
        order += [pieces[2 * r + 1] for r in reversed(range(self.size))]
        return torch.cat(order, dim=2)
