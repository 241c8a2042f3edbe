"""Lightning ``CheckpointIO`` for single-file checkpoints: atomic saves, safe loads, any layout.

The strategies that keep a whole model per process (one process, Lightning's ``ddp``)
save and load through a CheckpointIO plugin. This one writes each file atomically (to
``<name>.partial``, then renamed), loads only tensors and plain data
(``weights_only=True``), and also reads the sharded DCP directories of every other
strategy, so a checkpoint of any layout resumes in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

from plugintrain.checkpoints.dcp import read_full
from plugintrain.checkpoints.files import SOURCE_KEY, load_torch_file
from plugintrain.core.atomic_files import remove, write_file_atomically


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic, code-free single-file checkpoints; reads sharded directories too."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if "://" in str(path):  # object stores: fsspec's own transaction semantics
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take `storage_options`.")
        write_file_atomically(Path(path), lambda stream: torch.save(checkpoint, stream))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" in str(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        path = Path(path)
        if path.is_dir():
            checkpoint = read_full(path)
        elif path.exists():
            checkpoint = load_torch_file(path, map_location=map_location or "cpu")
        else:
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        checkpoint[SOURCE_KEY] = str(path)  # for one-line errors in the module's hooks
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if "://" in str(path):
            super().remove_checkpoint(path)
        else:
            remove(Path(path))
