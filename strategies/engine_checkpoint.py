"""The gradient engine's optimizer state in sharded (DCP) checkpoints, by full parameter name.

Each rank writes, for each parameter its optimizer steps, the flat range it owns (its ZeRO
shard of its tp shard) as the few boxes of the parameter-shaped tensor the range covers
(:class:`~plugintrain.checkpoints.dcp.ShardBoxes`). DCP records them as chunks of one
tensor per state key (``optimizer_0.state.<name>.exp_avg``), exactly as it records a
DTensor's shards; ZeRO-0 replicas write identical chunks, which DCP keeps once. On load
each rank asks for the boxes of the ranges it owns under the new layout, so any dp x tp x
pp layout and ZeRO stage resumes any other; a tied head's state is found under either
name of the pair. The boxes are views of the optimizer's own flat state tensors, so a
save or load adds at most one saved chunk to the peak.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer

from plugintrain.checkpoints.dcp import (
    SavedMetadata,
    ShardBoxes,
    load_states,
    open_checkpoint,
    read_rest,
)
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.optimizer_shards import is_elementwise
from plugintrain.strategies.tied import TiedParameters


@dataclasses.dataclass
class EngineCheckpoint:
    """Saves and loads a gradient engine's optimizer state in DCP directories, per rank.

    Args:
        engine: The data-parallel gradient engine the optimizers are attached to.
        tied: Tied parameters (a tied head's state is found under the embedding's name).
    """

    engine: GradientEngine
    tied: TiedParameters = dataclasses.field(default_factory=TiedParameters)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's share of ``optimizer``'s state for DCP: elementwise values as the
        boxes of the ranges it owns, scalars (``step``) as they are, and the groups'
        hyperparameters. Communicates nothing."""
        state = {}
        for owned in self.engine.shards.owned(optimizer):
            numel = owned.shard.numel()
            state[owned.name] = {
                key: ShardBoxes.of_range(owned.param, owned.start, value.reshape(-1))
                if is_elementwise(value, numel)
                else value
                for key, value in optimizer.state.get(owned.shard, {}).items()
            }
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": []}
            for group in optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load(self, path: Path, model: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
        """Load model weights and optimizer state from the checkpoint at ``path`` (a DCP
        directory of any layout, or one file).

        Returns:
            The rest of the checkpoint (loops, callbacks, ...) from its metadata.
        """
        names = [[self.engine.shards.parameter_names(optimizer)] for optimizer in optimizers]
        reader = open_checkpoint(path, names)
        saved = reader.read_metadata().state_dict_metadata
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        shard_states = []
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"], targets = self._template(f"optimizer_{i}.", optimizer, saved)
            shard_states.append(targets)
        load_states(model, state, reader)
        for i, (optimizer, targets) in enumerate(zip(optimizers, shard_states, strict=True)):
            groups = state[f"optimizer_{i}"]["param_groups"]
            self.engine.shards.load_shards(optimizer, targets, groups)
        return read_rest(reader)

    def _template(
        self, prefix: str, optimizer: Optimizer, saved: SavedMetadata
    ) -> tuple[dict[str, Any], dict[Tensor, dict[str, Tensor]]]:
        """What this rank reads of one optimizer (DCP fills it in place), and the same
        tensors keyed by the shard parameters they become the state of."""
        groups = _saved_groups(saved, prefix + "param_groups.")
        if not groups:
            raise ValueError(
                f"The checkpoint holds no optimizer state for {prefix.rstrip('.')} (saved"
                " weights-only, or with fewer optimizers); resume from a full checkpoint or"
                " load only its weights."
            )
        state: dict[str, dict[str, Any]] = {}
        targets: dict[Tensor, dict[str, Tensor]] = {}
        for owned in self.engine.shards.owned(optimizer):
            name, keys = self._saved_state(saved, prefix, owned.name)
            shard = owned.shard
            state[name], targets[shard] = {}, {}
            for key, meta in keys.items():
                dtype = meta.properties.dtype
                if tuple(meta.size) == tuple(owned.param.shape) and len(meta.size) > 0:
                    flat = torch.empty(shard.numel(), dtype=dtype, device=shard.device)
                    state[name][key] = ShardBoxes.of_range(owned.param, owned.start, flat)
                else:
                    flat = torch.empty(meta.size, dtype=dtype)
                    state[name][key] = flat
                targets[shard][key] = flat
        # DCP stores each group's hyperparameters as one entry per key; None is a slot.
        return {"state": state, "param_groups": groups}, targets

    def _saved_state(
        self, saved: SavedMetadata, prefix: str, name: str
    ) -> tuple[str, dict[str, TensorStorageMetadata]]:
        """The name under which ``name``'s state was saved (itself or a tied alias) and its
        tensor entries (none if the parameter had no state yet)."""
        for candidate in (name, *self.tied.aliases(name)):
            keys = _state_keys(saved, f"{prefix}state.{candidate}.")
            if keys:
                return candidate, keys
        return name, {}


def _saved_groups(saved: SavedMetadata, prefix: str) -> list[dict[str, None]]:
    """Slots for each saved param group's entries under ``prefix`` (``lr``, ``betas``...)."""
    groups: dict[int, dict[str, None]] = {}
    for key in saved:
        if key.startswith(prefix):
            index, _, name = key[len(prefix) :].partition(".")
            groups.setdefault(int(index), {})[name] = None
    return [groups[i] for i in sorted(groups)]


def _state_keys(saved: SavedMetadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    """Saved tensor entries directly under ``prefix`` (``exp_avg``, ``step``, ...)."""
    return {
        key[len(prefix) :]: meta
        for key, meta in saved.items()
        if key.startswith(prefix)
        and "." not in key[len(prefix) :]
        and isinstance(meta, TensorStorageMetadata)
    }
