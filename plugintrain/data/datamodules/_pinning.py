"""Whether a datamodule's loaders pin their batches in page-locked host memory."""

from __future__ import annotations

from typing import Any


def pin_memory_for(trainer: Any) -> bool:
    """Pin when the batches go to a CUDA device.

    A copy from pinned memory can run asynchronously, and Lightning's batch transfer
    (``move_data_to_device``) already passes ``non_blocking=True`` for CUDA, so the copy of
    the next batch overlaps with the work still queued on the GPU. On the CPU there is no
    copy to overlap (and torch warns about pinning without an accelerator).

    Args:
        trainer: The trainer the datamodule is attached to, or None outside one.
    """
    return trainer is not None and trainer.strategy.root_device.type == "cuda"
