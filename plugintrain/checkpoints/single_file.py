"""Read a single-file checkpoint as if it were a DCP directory, so any layout resumes it.

A checkpoint written by one process (or by Lightning's ``ddp``) is one torch file holding
whole tensors, with optimizer state keyed by position in the optimizer's groups. The
sharded strategies load through torch.distributed.checkpoint (DCP), which asks a
``StorageReader`` for the boxes each rank owns under its layout. :class:`SingleFileReader`
is that reader over one file: it presents the file's weights and optimizer state under
DCP's flattened full-name keys (``state_dict.<name>``,
``optimizer_0.state.<name>.exp_avg``, ``optimizer_0.param_groups.0.lr``), exactly the keys
a sharded save writes, and serves each requested box from the file memory-mapped, so a rank
touches only the pages of what it owns.

Position-keyed optimizer state gets its names from the file's ``optimizer_param_names``
(written beside it by :class:`~plugintrain.checkpoints.portable.PortableCheckpoints`),
else ``fallback_names`` (the loading optimizer's own order, right when it steps the whole
model, as for a checkpoint Lightning's own ``ddp`` wrote) if they fit.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from plugintrain.checkpoints.files import OPTIMIZER_NAMES_KEY, load_torch_file

GroupNames = list[list[str]]


class SingleFileReader(StorageReader):
    """DCP ``StorageReader`` over one torch checkpoint file (loaded ``weights_only``, mmapped).

    Args:
        path: The checkpoint file.
        fallback_names: Per optimizer, group names to use when the file does not say.
    """

    def __init__(self, path: Path, fallback_names: Sequence[GroupNames] = ()) -> None:
        super().__init__()
        self.path = Path(path)
        checkpoint = load_torch_file(self.path, mmap=True, map_location="cpu")
        self.flat, _ = flatten_state_dict(_dcp_layout(checkpoint, fallback_names, self.path))
        self.rest = {
            k: v
            for k, v in checkpoint.items()
            if k not in ("state_dict", "optimizer_states", OPTIMIZER_NAMES_KEY)
        }

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries: dict[str, Any] = {}
        for key, value in self.flat.items():
            if isinstance(value, Tensor):
                size = value.size()
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
                properties = TensorProperties(dtype=value.dtype)
                entries[key] = TensorStorageMetadata(properties, size, [chunk])
            else:
                entries[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **_: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            value = self.flat[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = value
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return Path(checkpoint_id).is_file()


def _dcp_layout(
    checkpoint: dict[str, Any], fallback_names: Sequence[GroupNames], path: Path
) -> dict[str, Any]:
    """The nested dict a sharded save of the same training state would have written."""
    layout: dict[str, Any] = {"state_dict": dict(checkpoint.get("state_dict", {}))}
    names_per_optimizer = checkpoint.get(OPTIMIZER_NAMES_KEY) or list(fallback_names)
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        names = names_per_optimizer[i] if i < len(names_per_optimizer) else None
        layout[f"optimizer_{i}"] = _by_name(state, names, path)
    return layout


def _by_name(state: dict[str, Any], names: GroupNames | None, path: Path) -> dict[str, Any]:
    """One optimizer's ``state_dict()`` keyed by parameter name, groups without ``params``."""
    keys = [key for group in state["param_groups"] for key in group["params"]]
    if not all(isinstance(key, str) for key in keys):
        flat = [name for group in names or [] for name in group]
        if len(flat) != len(keys):
            raise ValueError(
                f"{path} keys its optimizer state by position and does not name the"
                f" {len(keys)} parameters (it predates {OPTIMIZER_NAMES_KEY!r}); resume it"
                " once in one process or under zero1/zero2 and save, then use that checkpoint."
            )
        rename = dict(zip(keys, flat, strict=True))
        state = {**state, "state": {rename[k]: v for k, v in state["state"].items()}}
    groups = [
        {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for group in state["param_groups"]
    ]
    for group in groups:
        group["params"] = []
    return {"state": dict(state["state"]), "param_groups": groups}
