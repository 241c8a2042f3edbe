"""LiveTensorMemory against byte counts known by construction (the reference): what it
must count (allocations, torch.load's storages, a DTensor's local shard) and what it must
not (views, in-place results, tensors that existed before it and are only mutated)."""

from __future__ import annotations

import io

import torch

from plugintrain.core.memory import LiveTensorMemory

MIB = 2**20


def test_counts_allocations_once_per_storage_until_freed() -> None:
    with LiveTensorMemory() as memory:
        a = torch.zeros(MIB // 4)  # 1 MiB
        view = a.view(-1, 2)
        a.add_(1)
        assert memory.live_bytes == MIB
        b = a + 1
        assert memory.live_bytes == 2 * MIB
        del b
        assert memory.live_bytes == MIB and memory.peak_bytes == 2 * MIB
        del a, view
        assert memory.live_bytes == 0


def test_mutating_untracked_tensors_allocates_nothing() -> None:
    before = [torch.zeros(MIB // 4) for _ in range(4)]
    with LiveTensorMemory() as memory:
        torch._foreach_add_(before, 1.0)  # returns nothing, mutates its inputs
        before[0].mul_(2)
        assert memory.peak_bytes == 0


def test_counts_what_torch_load_reads() -> None:
    buffer = io.BytesIO()
    torch.save(torch.zeros(MIB // 4), buffer)
    buffer.seek(0)
    with LiveTensorMemory() as memory:
        loaded = torch.load(buffer, weights_only=True)
        assert memory.live_bytes == MIB
        del loaded
    assert memory.peak_bytes == MIB and memory.live_bytes == 0


def test_track_counts_existing_tensors() -> None:
    weight = torch.zeros(MIB // 4)
    with LiveTensorMemory() as memory:
        memory.track([weight])
        assert memory.live_bytes == MIB
        memory.reset_peak()
        assert memory.peak_bytes == MIB
