"""The world a dry run plays in: torch's fake process group, rank R of N in one process,
and which of its N ranks to build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

# torch ships its fake process group (every collective returns at once, moving nothing) only
# with its test utilities, torch.testing._internal: imported here and nowhere else in the
# library, so a move there breaks one line. Checked on torch 2.13.
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

from plugintrain.estimate.layout import Layout

BACKEND = "plugintrain_dry_run"
"""torch's ``fake`` process group, registered for the meta device too (pipeline sends and
receives of meta tensors go through ``batch_isend_irecv``, which asks for the tensors'
device's backend)."""


def _register_backend() -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(
            BACKEND, _create_fake_pg, extended_api=True, devices=["cpu", "meta"]
        )


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as torch's ``fake`` backend, rank ``rank`` of
    ``world_size`` (collectives return at once, moving nothing)."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    _register_backend()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sample_ranks(layout: Layout) -> list[int]:
    """One rank of every kind: per pipeline stage, the first and last dp rank (ZeRO's
    padding lands on the last), the first and last cp rank and the first and last tp rank;
    every rank of a small layout."""
    dims = layout.dims
    picked = {
        layout.rank_of(pp, dp, tp, cp)
        for pp in range(dims.pp)
        for dp in sorted({0, dims.dp - 1})
        for cp in sorted({0, dims.cp - 1})
        for tp in sorted({0, dims.tp - 1})
    }
    return sorted(picked)


def parse_ranks(text: str, layout: Layout) -> list[int]:
    """``--ranks``: ``sample`` (:func:`sample_ranks`), ``all``, or comma-separated ranks."""
    if text == "all":
        return list(range(layout.world_size))
    if text == "sample":
        return sample_ranks(layout)
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--ranks={text!r}: give sample, all or ranks like 0,5,1023") from None
    bad = [r for r in ranks if not 0 <= r < layout.world_size]
    if bad:
        raise ValueError(
            f"--ranks={text!r}: rank {bad[0]} is not in 0..{layout.world_size - 1}"
            f" (world size {layout.world_size})"
        )
    return ranks
