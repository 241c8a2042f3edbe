"""Sharded checkpoints as torch.distributed.checkpoint (DCP) directories, written shard by shard.

Model weights and optimizer state are saved under full-model parameter names, so they
reload under any dp x tp x pp (x vpp) layout and in one process. Nothing is gathered to
one rank: a rank writes the boxes of each tensor it holds (:class:`ShardBoxes`: a
DTensor's shard, or the ranges of a ZeRO shard, from
:func:`plugintrain.core.tensor_boxes.flat_boxes`), and on load asks for the boxes it holds
under the new layout; DCP reads the overlapping parts of whatever chunks were saved.

Memory: a save writes files of at most one gradient bucket (:class:`BoundedFileWriter`:
DCP's writer keeps what it wrote until the file closes); a load reads one saved chunk at
a time (:class:`ChunkByChunkReader`); neither starts before the communication backend has
let go of the buffers of DCP's planning collectives (:class:`CollectiveBuffers`). The
gradient engine's optimizer state is laid out by
:mod:`plugintrain.strategies.engine_checkpoint`; the parsing of DCP's flattened keys
(``optimizer_0.state.<name>.exp_avg``) lives here and there only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from plugintrain.checkpoints.files import (
    LIGHTNING_METADATA,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    check_shard_files,
    consecutive_groups,
    first_line,
    load_torch_file,
    read_dcp_metadata,
    shape_mismatch,
)
from plugintrain.checkpoints.portable import plain_hyperparameters
from plugintrain.checkpoints.single_file import SingleFileReader
from plugintrain.core.atomic_files import PARTIAL_SUFFIX, publish, sibling, write_file_atomically
from plugintrain.core.tensor_boxes import flat_boxes, local_box

# DCP's metadata is a flat dict of dotted keys; everything this module reads from it.
SavedMetadata = dict[str, Any]


@dataclasses.dataclass
class ShardBoxes:
    """A parameter-shaped tensor of which this rank holds some boxes, as DCP chunks.

    Implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``, as DTensor does); the planners
    below resolve its chunks.

    Attributes:
        shape: The whole tensor's shape (the parameter's).
        boxes: ``(offsets in the whole tensor, tensor of the box's shape)`` pairs.
    """

    shape: torch.Size
    boxes: list[tuple[torch.Size, Tensor]]

    @classmethod
    def of_range(cls, param: Tensor, start: int, flat: Tensor) -> ShardBoxes:
        """``flat`` (a 1-D tensor) laid over elements ``[start, start + flat.numel())`` of
        ``param``'s local tensor (its tp shard, placed in the whole parameter)."""
        _, (origin, local_shape) = local_box(param)
        boxes, position = [], 0
        for offsets, sizes in flat_boxes(local_shape, start, flat.numel()):
            numel = math.prod(sizes)
            where = torch.Size(o + g for o, g in zip(offsets, origin, strict=True))
            boxes.append((where, flat[position : position + numel].view(sizes)))
            position += numel
        return cls(torch.Size(param.shape), boxes)

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP checks it against the saved one on load)."""
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=box.size()),
                    properties=TensorProperties.create_from_tensor(box),
                    size=self.shape,
                ),
            )
            for offsets, box in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=box.size()) for o, box in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for offsets, box in self.boxes:
            if offsets == index.offset:
                return box
        raise ValueError(f"No box at {index.offset} of {index.fqn}.")


RELEASE_TIMEOUT_S = 10.0
"""How long a save or load waits for the backend to let go of its coordination's buffers."""


class CollectiveBuffers(TorchDispatchMode):
    """The storages of the tensors handed to c10d collectives under it, until the
    communication backend has let go of them (weak references).

    DCP coordinates a save or load by object collectives: every rank's plan pickled into a
    tensor, gathered to the coordinator, the final plans scattered back. Gloo runs a
    collective on a worker thread and drops its tensors there only after the caller saw it
    complete, once that thread is scheduled again (and holds the GIL), so on a busy machine
    the scattered pickles outlived the scatter and met the first bucket being staged.
    :meth:`wait_released` waits until they are freed. Only host-memory buffers are
    watched: NCCL's live on the device, apart from the staging in host memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[int, weakref.ref] = {}  # id of a live storage -> its weak reference
        self._released = threading.Event()  # set (on the thread that frees it) once none is

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, Tensor):
                    self._hold(value.untyped_storage())
        return func(*args, **(kwargs or {}))

    def _hold(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != "cpu":  # NCCL's buffers live on the device, the staging
            return  # in host memory: nothing to wait for
        key = id(storage)
        if key not in self._held:  # a live key is that storage: its callback frees the key
            self._held[key] = weakref.ref(storage, self._forget(key))

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        def forget(_: weakref.ref) -> None:
            self._held.pop(key, None)
            if not self._held:
                self._released.set()

        return forget

    def wait_released(self, timeout: float = RELEASE_TIMEOUT_S) -> None:
        """Return once every buffer handed to a collective so far is freed (at most
        ``timeout`` seconds; then warn and go on)."""
        deadline = time.monotonic() + timeout
        while self._held:
            self._released.clear()
            if self._held and not self._released.wait(deadline - time.monotonic()):
                warnings.warn(
                    f"The communication backend still holds {len(self._held)} buffers of"
                    f" DCP's coordination after {timeout:.0f} s; reading or writing the"
                    " checkpoint's tensors beside them.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving :class:`ShardBoxes` chunks too, and staging
    nothing before the coordination's buffers are freed (run DCP under
    :attr:`collectives`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.collectives = CollectiveBuffers()

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.collectives.wait_released()  # the last collective before the writes
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardBoxes):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, resolving :class:`ShardBoxes` chunks and reading the
    non-tensor entries (hyperparameters) without unpickling code; reading nothing before
    the coordination's buffers are freed (run DCP under :attr:`collectives`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.collectives = CollectiveBuffers()

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        self.collectives.wait_released()  # the last collective before the reads
        return super().finish_plan(central_plan)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # DCP's set-up rebuilds the dict and drops types it does not know: set the boxes
        # aside and put them back under their flattened keys.
        boxes: dict[tuple[str, ...], ShardBoxes] = {}
        _take_boxes(state_dict, (), boxes)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert self.flatten_state_dict
        for path, value in boxes.items():
            set_element(self.original_state_dict, path, value)
            self.state_dict[".".join(path)] = value

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardBoxes):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # Plain values (an optimizer group's ``lr``), never code; on the host, where a value
        # saved on cuda:k would otherwise land on cuda:k.
        loaded = torch.load(value, weights_only=True, map_location="cpu")
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


DEFAULT_FILE_BYTES = 25 * 2**20
"""Largest checkpoint file a rank writes (the gradient engine's default bucket size)."""


class BoundedFileWriter(FileSystemWriter):
    """DCP's file writer, in files of at most ``file_bytes`` each (a larger chunk alone).

    DCP's writer keeps every tensor it wrote to a file (and the copy it makes of a view,
    such as a parameter inside a gradient bucket) until the file is closed: one file per
    rank would hold the rank's whole share in memory, one file per chunk would make
    thousands of files. Files of a bucket's size bound both.
    """

    def __init__(self, path: Path, file_bytes: int = DEFAULT_FILE_BYTES) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.file_bytes = file_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix, results = plan.storage_data.prefix, []
        for index, items in enumerate(consecutive_groups(plan.items, _nbytes, self.file_bytes)):
            storage = dataclasses.replace(plan.storage_data, prefix=f"{prefix}{index}_")
            part = dataclasses.replace(plan, items=items, storage_data=storage)
            results += super().write_data(part, planner).wait()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _nbytes(item: WriteItem) -> int:
    data = item.tensor_data
    return 0 if data is None else math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


class ChunkByChunkReader(FileSystemReader):
    """DCP's file reader, handed one read at a time: the stock loop keeps the chunk it
    read last alive while it reads the next, so two saved chunks would meet in memory.

    Its metadata is read with an allow-listed unpickler (DCP's stock reader unpickles
    freely), and the shard files it names are checked for length first, so a truncated
    checkpoint is an error naming the file rather than an ``EOFError`` mid-load.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        check_shard_files(Path(self.path), metadata.storage_data or {})
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except pickle.UnpicklingError as error:
                file = Path(self.path) / self.storage_data[item.storage_index].relative_path
                raise UnsafeCheckpointError(
                    f"{file} holds a value ({item.storage_index.fqn}) that loading would have"
                    f" to run code for ({first_line(error)}); plugintrain loads only tensors"
                    " and plain data: use a checkpoint plugintrain wrote."
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


HPARAMS_FILENAME = "hyper_parameters.json"
"""The module's hyperparameters as JSON, so tools rebuild the model without unpickling."""


def _plain_values(hparams: Any) -> dict[str, Any]:
    """The hyperparameters JSON can hold (a dataclass as its fields); others are left out."""
    plain = {}
    for key, value in plain_hyperparameters(hparams).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        plain[key] = value
    return plain


def read_hparams(path: Path) -> dict[str, Any]:
    """The hyperparameters :func:`save_directory` wrote beside the shards (JSON: no code)."""
    file = path / HPARAMS_FILENAME
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} has no {HPARAMS_FILENAME}, which every sharded checkpoint plugintrain"
            " writes holds: pass a checkpoint directory written by `plugintrain fit`."
        )
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpointError(
            f"{file} is not JSON ({error}); plugintrain writes it as JSON and reads nothing"
            " else there: resume from a checkpoint plugintrain wrote."
        ) from None


def _take_boxes(
    state: dict[str, Any], path: tuple[str, ...], taken: dict[tuple[str, ...], ShardBoxes]
) -> None:
    """Move every :class:`ShardBoxes` of the nested dict ``state`` into ``taken`` (by path),
    leaving ``None`` in its place."""
    for key, value in state.items():
        if isinstance(value, dict):
            _take_boxes(value, (*path, str(key)), taken)
        elif isinstance(value, ShardBoxes):
            taken[(*path, str(key))] = value
            state[key] = None


def save_directory(
    checkpoint: dict[str, Any],
    path: Path,
    write_metadata: bool,
    file_bytes: int = DEFAULT_FILE_BYTES,
) -> None:
    """Write Lightning's ``checkpoint`` dict as a DCP directory at ``path``, atomically.

    Model and optimizer tensors go shard by shard from every rank (the optimizer states are
    :meth:`EngineCheckpoint.optimizer_state`'s); the rest (loops, callbacks,
    hyperparameters) goes to the metadata file, written by the rank with
    ``write_metadata``. Everything is written to ``<path>.partial`` and that rank renames
    it onto ``path`` (replacing an older checkpoint or single file there) only once every
    rank's shards and the metadata are on disk. Each rank's files hold at most
    ``file_bytes`` (or one larger chunk). Every rank calls this.
    """
    partial = sibling(path, PARTIAL_SUFFIX)
    if write_metadata and partial.exists():
        shutil.rmtree(partial)  # left by a save killed before it completed
    planner = ShardSavePlanner()
    with planner.collectives:  # the barrier's and the planning's buffers, until freed
        _barrier()
        partial.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        writer = BoundedFileWriter(partial, file_bytes)
        dcp.save(state, storage_writer=writer, planner=planner)
    if write_metadata:  # DCP returns on every rank once all shards and .metadata are written
        hparams = _plain_values(checkpoint.get("hyper_parameters", {}))
        write_file_atomically(partial / HPARAMS_FILENAME, lambda f: f.write(_json(hparams)))
        write_file_atomically(partial / LIGHTNING_METADATA, lambda f: torch.save(checkpoint, f))
        publish(partial, path)
    _barrier()  # no rank returns (and maybe reads it) before it is in place


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _json(value: Any) -> bytes:
    return json.dumps(value, indent=1).encode()


def check_local_path(path: Any, owner: str) -> None:
    """Sharded checkpoints live on a filesystem every rank reaches; refuse object stores."""
    if "://" in str(path):
        raise ValueError(
            f"{owner} writes each rank's shards to a directory every rank can reach;"
            f" got the remote path {str(path)!r}: save to a local or mounted filesystem."
        )


def load_dtensor_states(
    path: Path, model: nn.Module, optimizers: Sequence[Optimizer]
) -> dict[str, Any]:
    """Load FSDP2's model and optimizer (DTensor states, by torch's own state-dict API)
    from a checkpoint of any layout; returns the rest of the checkpoint."""
    reader = open_checkpoint(path)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer)
    load_states(model, state, reader)
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"])
    return read_rest(reader)


def open_checkpoint(path: Path, fallback_names: Sequence[list[list[str]]] = ()) -> Any:
    """A DCP reader of the checkpoint at ``path``: a sharded directory, or one torch file
    (any layout resumes either). ``fallback_names`` name position-keyed optimizer state
    in files that do not (see :class:`SingleFileReader`)."""
    if path.is_dir():
        return ChunkByChunkReader(path)
    return SingleFileReader(path, fallback_names)


def read_rest(reader: Any) -> dict[str, Any]:
    """The non-tensor part of a checkpoint (loops, callbacks, hyperparameters), without
    unpickling anything but tensors and plain data."""
    if isinstance(reader, SingleFileReader):
        return dict(reader.rest)
    # On the host whatever device the saving rank's tensors (callbacks', loops') were on.
    return load_torch_file(Path(reader.path) / LIGHTNING_METADATA, map_location="cpu")


def load_weights(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load only the model weights of the checkpoint at ``path`` (a DCP directory or one
    file; evaluation, where no optimizer exists); returns the rest of the checkpoint."""
    reader = open_checkpoint(path)
    load_states(model, {"state_dict": get_model_state_dict(model)}, reader)
    return read_rest(reader)


def read_weights(path: Path) -> dict[str, Tensor]:
    """The whole model weights of the DCP directory ``path`` by full name, in this process
    (``generate``, exporting): only the ``state_dict`` entries are read, never the optimizer
    state, and nothing is unpickled but DCP's metadata, through an allow-list."""
    reader = ChunkByChunkReader(path)
    saved = reader.read_metadata().state_dict_metadata
    prefix = "state_dict."
    weights = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    state = {"state_dict": weights}
    load_dcp(state, reader)
    return state["state_dict"]


def read_full(path: Path) -> dict[str, Any]:
    """The DCP directory ``path`` as one process's Lightning checkpoint dict: whole weights,
    each optimizer's whole state keyed by parameter name (see
    :class:`~plugintrain.checkpoints.portable.PortableCheckpoints`), and the rest. For a
    process that holds the whole model (and so its whole optimizer state) anyway."""
    reader = ChunkByChunkReader(path)
    state: dict[str, Any] = {"state_dict": {}}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        slot = None
        if isinstance(meta, TensorStorageMetadata):
            slot = torch.empty(meta.size, dtype=meta.properties.dtype)
        _place(state, key, slot)
    load_dcp(state, reader)
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=_index)
    optimizer_states = [state.pop(key) for key in optimizers]
    for optimizer_state in optimizer_states:
        groups = optimizer_state["param_groups"]
        optimizer_state["param_groups"] = [groups[i] for i in sorted(groups, key=int)]
    rest = read_rest(reader)
    return {**rest, "state_dict": state["state_dict"], "optimizer_states": optimizer_states}


def _index(key: str) -> int:
    return int(key.split("_", 1)[1])


def _place(state: dict[str, Any], key: str, slot: Tensor | None) -> None:
    """Put ``slot`` where DCP's flattened ``key`` points in the nested ``state``."""
    head, _, tail = key.partition(".")
    if head == "state_dict":
        state["state_dict"][tail] = slot
        return
    optimizer = state.setdefault(head, {"state": {}, "param_groups": {}})
    kind, _, tail = tail.partition(".")
    if kind == "state":
        name, _, entry = tail.rpartition(".")
        optimizer["state"].setdefault(name, {})[entry] = slot
    else:  # "param_groups"
        index, _, entry = tail.partition(".")
        optimizer["param_groups"].setdefault(index, {})[entry] = slot


def load_dcp(state: dict[str, Any], reader: Any, alone: bool = False) -> None:
    """``dcp.load`` with our planner, raising a checkpoint error of ours as itself (DCP
    wraps every rank's failure into one multi-line ``CheckpointException``).

    ``alone``: this process reads without its peers (no collective), e.g. the tensors of
    its own pipeline stage, which differ from the other stages' in name and number."""
    planner = ShardLoadPlanner()
    try:
        with planner.collectives:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=alone)
    except CheckpointException as error:
        for failure in error.failures.values():  # rank -> (exception, traceback)
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError)):
                raise cause from None
        raise


def load_states(model: nn.Module, state: dict[str, Any], reader: Any) -> None:
    """Fill ``state`` (the model's state dict under ``"state_dict"``, optimizer templates)
    from ``reader``, one chunk at a time, and load the weights into ``model``.

    A module with ``strict_loading = False`` (a LoRA run, whose base weights come from
    their own file) takes a checkpoint without its frozen weights; every weight that
    trains must be there.
    """
    strict = getattr(model, "strict_loading", True) is not False
    if not strict:
        state["state_dict"] = _held_or_trained(reader, state["state_dict"], model)
    check_shapes(reader, state["state_dict"])
    load_dcp(state, reader)
    model.load_state_dict(state["state_dict"], strict=strict)


def _held_or_trained(reader: Any, model_state: dict[str, Any], model: nn.Module) -> dict:
    """The entries of ``model_state`` the checkpoint holds, plus every trainable one (so
    a missing trainable weight is still named by :func:`check_shapes`)."""
    saved = reader.read_metadata().state_dict_metadata
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_state.items() if f"state_dict.{k}" in saved or k in trained}


def check_shapes(reader: Any, model_state: dict[str, Any]) -> None:
    """Every model tensor is in the checkpoint with the model's full shape.

    Raises:
        ValueError: One line naming the checkpoint, the first differing tensor and both
            shapes (DCP's own error is a dump of every mismatch, or a bare assertion).
    """
    saved = reader.read_metadata().state_dict_metadata
    where = getattr(reader, "path", "the checkpoint")
    for name, tensor in model_state.items():
        meta = saved.get(f"state_dict.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(
                f"{where} has no weight {name!r} that the model has; was it saved from another"
                " model? Pass the model options it was trained with (its hyper_parameters)."
            )
        if tuple(meta.size) != tuple(tensor.shape):
            raise shape_mismatch(where, name, meta.size, tensor.shape)
