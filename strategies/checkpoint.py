"""Checkpoint layout of the engine-backed model-parallel strategies (DCP directories).

Model weights are saved by Lightning's ``ModelParallelStrategy`` as a
torch.distributed.checkpoint (DCP) directory keyed by full-model parameter names, so they
reload under any pp x tp x dp layout. This module owns what the gradient engine adds:

- **Optimizer state, saved.** With ``tensor_parallel == 1`` each parameter's whole state
  (gathered over dp by the engine) is saved under its name, so any pp x dp layout and
  ZeRO stage can read it; with tp > 1 each rank saves its own shard's state as a byte
  stream (same layout to resume).
- **Optimizer state, loaded.** Templates of what this rank reads (its parameters' tensors
  by name, found under the name or a tied alias, shaped from the checkpoint's metadata;
  the param groups' hyperparameters), then keyed back by this optimizer's own names.

The parsing of DCP's flattened keys (``optimizer_0.state.<name>.exp_avg``,
``optimizer_0.param_groups.<i>.lr``) lives only here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer

from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.tied import TiedParameters

# DCP's metadata is a flat dict of dotted keys; everything this module reads from it.
SavedMetadata = dict[str, Any]


@dataclass
class EngineCheckpoint:
    """Saves and loads optimizer state of a gradient engine in DCP directories.

    Args:
        engine: The data-parallel gradient engine the optimizers are attached to.
        tied: Tied parameters (a tied head's state is found under the embedding's name).
        tensor_parallel: The tp degree (> 1: per-rank optimizer shards).
        rank: This process's global rank.
        world_size: The number of processes.
    """

    engine: GradientEngine
    tied: TiedParameters
    tensor_parallel: int
    rank: int
    world_size: int

    @property
    def shard_key(self) -> str:
        """The key of this rank's optimizer shard in a tp > 1 checkpoint."""
        return f"rank{self.rank}_of{self.world_size}"

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """What DCP saves for ``optimizer`` (every rank calls this)."""
        if self.tensor_parallel == 1:
            # Whole tensors keyed by parameter name, gathered to each dp group's rank 0:
            # DCP stores each name once, so any pp x dp layout (and ZeRO stage) can read it.
            full = self.engine.optimizer_state_dict(optimizer)
            groups = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": []}
                for group in optimizer.param_groups
            ]
            return {"state": full.get("state", {}), "param_groups": groups}
        # Each rank saves its own shard's state; DCP stores it as an opaque byte stream.
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        return {self.shard_key: buffer}

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: list[Optimizer],
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load model weights and optimizer state from the DCP directory ``path``.

        Returns:
            The rest of the checkpoint (loops, callbacks, ...) from its metadata file.
        """
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = self._template(f"optimizer_{i}.", optimizer, saved)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["state_dict"])
        for i, optimizer in enumerate(optimizers):
            self._restore(optimizer, state[f"optimizer_{i}"])
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _template(self, prefix: str, optimizer: Optimizer, saved: SavedMetadata) -> dict[str, Any]:
        """What this rank reads of one optimizer: its own parameters' tensors by name
        (under any layout), or its own byte-stream shard (a tp > 1 checkpoint)."""
        groups = _saved_groups(saved, prefix + "param_groups.")
        if not groups:
            if prefix + self.shard_key not in saved:
                raise ValueError(
                    f"The checkpoint's optimizer state was saved per rank by a layout with"
                    f" tensor_parallel > 1 and has no shard for rank {self.rank} of"
                    f" {self.world_size}; resume it with the layout that saved it."
                )
            return {self.shard_key: io.BytesIO()}
        state: dict[str, dict[str, Tensor]] = {}
        for name in self.engine.parameter_names(optimizer):
            for candidate in (name, *self.tied.aliases(name)):
                keys = _state_keys(saved, f"{prefix}state.{candidate}.")
                if keys:
                    state[candidate] = {
                        key: torch.empty(meta.size, dtype=meta.properties.dtype)
                        for key, meta in keys.items()
                    }
                    break
        # DCP stores each group's hyperparameters as one entry per key; None is a slot.
        return {"state": state, "param_groups": groups}

    def _restore(self, optimizer: Optimizer, loaded: dict[str, Any]) -> None:
        if "state" not in loaded:
            buffer = loaded[self.shard_key]
            buffer.seek(0)
            optimizer.load_state_dict(torch.load(buffer, weights_only=True))
            return
        # Key the loaded state by this optimizer's names (a tied head saved as the other).
        names = set(self.engine.parameter_names(optimizer))

        def own(name: str) -> str:
            return name if name in names else next(a for a in self.tied.aliases(name) if a in names)

        state = {own(name): values for name, values in loaded["state"].items()}
        self.engine.load_optimizer_state_dict(
            optimizer, {"state": state, "param_groups": loaded["param_groups"]}
        )


def _saved_groups(saved: SavedMetadata, prefix: str) -> list[dict[str, None]]:
    """Slots for each saved param group's entries under ``prefix`` (``lr``, ``betas``...)."""
    groups: dict[int, dict[str, None]] = {}
    for key in saved:
        if key.startswith(prefix):
            index, _, name = key[len(prefix) :].partition(".")
            groups.setdefault(int(index), {})[name] = None
    return [groups[i] for i in sorted(groups)]


def _state_keys(saved: SavedMetadata, prefix: str) -> dict[str, Any]:
    """Saved tensor entries directly under ``prefix`` (``exp_avg``, ``step``, ...)."""
    return {
        key[len(prefix) :]: meta
        for key, meta in saved.items()
        if key.startswith(prefix) and "." not in key[len(prefix) :] and hasattr(meta, "size")
    }
