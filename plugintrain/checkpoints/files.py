"""Checkpoints on disk: found by completeness, cleaned up after a kill, read without running code.

Every checkpoint plugintrain writes (one file, or a DCP directory of shards) is published
atomically (:mod:`plugintrain.core.atomic_files`), so a job killed mid-save leaves the
previous checkpoint intact; :func:`recover` (run at every start) finishes or undoes what a
killed save left.

Nothing here unpickles freely: torch files are read with ``weights_only=True`` (tensors and
plain containers only), and DCP's ``.metadata`` (a pickle torch writes) with an
unpickler that admits only DCP's own metadata classes, torch sizes and dtypes. Anything
else is refused with an error naming the file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path, PurePath
from typing import Any, TypeVar

import torch

from plugintrain.core.atomic_files import PARTIAL_SUFFIX, RETIRED_SUFFIX, remove

T = TypeVar("T")

DCP_METADATA = ".metadata"
LIGHTNING_METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a directory
SOURCE_KEY = "plugintrain_loaded_from"
"""Set on a loaded checkpoint dict (never saved): the path it came from, for error messages."""
OPTIMIZER_NAMES_KEY = "optimizer_param_names"
"""Single-file checkpoint key: per optimizer, its groups' parameter names in position order
(torch keys optimizer state by position; names let another layout find each parameter's)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain data."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated or not a checkpoint at all."""


def recover(directory: Path) -> list[str]:
    """Finish or undo what a killed save left in ``directory``; returns what was done.

    A ``<name>.retired`` without ``<name>`` is the previous checkpoint of a save killed
    between its two renames: it goes back. Every ``.partial`` and the other ``.retired``
    entries are leftovers and are deleted.
    """
    done: list[str] = []
    if not directory.is_dir():
        return done
    for entry in sorted(directory.iterdir()):
        if entry.name.endswith(RETIRED_SUFFIX):
            target = entry.with_name(entry.name[: -len(RETIRED_SUFFIX)])
            if not target.exists():
                os.replace(entry, target)
                done.append(f"restored {target} (a save was killed while replacing it)")
                continue
        elif not entry.name.endswith(PARTIAL_SUFFIX):
            continue
        remove(entry)
        done.append(f"removed {entry} (left by a killed save)")
    return done


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a published checkpoint: a file, or a directory with both
    metadata files."""
    if path.name.endswith((PARTIAL_SUFFIX, RETIRED_SUFFIX)):
        return False
    if path.is_dir():
        return (path / DCP_METADATA).is_file() and (path / LIGHTNING_METADATA).is_file()
    return path.is_file() and path.stat().st_size > 0


def newest_complete(directory: Path, pattern: str = "*.ckpt") -> Path | None:
    """The most recently completed checkpoint matching ``pattern`` in ``directory``."""
    found = [p for p in directory.glob(pattern) if is_complete(p)] if directory.is_dir() else []
    return max(found, key=lambda p: (_completed_at(p), p.name), default=None)


def _completed_at(path: Path) -> int:
    """When ``path`` was completed: a directory's last-written file is its Lightning metadata."""
    return (path / LIGHTNING_METADATA if path.is_dir() else path).stat().st_mtime_ns


def load_torch_file(path: Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``, with errors that name the file and say why.

    Raises:
        UnsafeCheckpointError: The file holds objects beyond tensors and plain data.
        CorruptCheckpointError: The file is truncated or not a torch file.
    """
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path} holds objects that loading would have to run code for"
            f" ({first_line(error)}); plugintrain loads only tensors and plain data: use a"
            " checkpoint plugintrain wrote, or re-save the weights with torch.save(state_dict)."
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CorruptCheckpointError(
            f"{path} is truncated or not a torch checkpoint ({first_line(error)}); resume"
            " from an earlier checkpoint in the same directory (--ckpt_path last picks the"
            " newest complete one)."
        ) from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's run to a page)."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    # torch's weights-only refusal opens with advice; the line that says what it met:
    reason = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    if reason:  # "... Unsupported global: GLOBAL os.system was not an allowed global ..."
        return reason[0].removeprefix("WeightsUnpickler error: ").split(" was not ")[0]
    return (lines or [type(error).__name__])[0]


# DCP's metadata pickle, by module: the classes torch writes into it and nothing else.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``torch.Size`` and dtypes/layouts; refuses the rest."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")


def read_dcp_metadata(directory: Path) -> Any:
    """DCP's ``Metadata`` of ``directory``, unpickled with the allow-list above.

    Raises:
        UnsafeCheckpointError: The metadata pickle refers to anything else.
        CorruptCheckpointError: It is truncated.
    """
    file = directory / DCP_METADATA
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{file} refers to {first_line(error).split(' is not')[0]}, which DCP metadata"
            " never holds; plugintrain does not run code from checkpoints: use a checkpoint"
            " it wrote."
        ) from None
    except (EOFError, ValueError, AttributeError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{file} is truncated or not DCP metadata ({first_line(error)}); resume from an"
            " earlier checkpoint (--ckpt_path last picks the newest complete one)."
        ) from None
    if getattr(metadata, "storage_meta", None) is not None:
        metadata.storage_meta.checkpoint_id = PurePath(directory)
    return metadata


def shape_mismatch(where: Any, name: str, saved: Any, model: Any) -> ValueError:
    """The one-line error for a weight whose saved shape differs from the model's."""
    return ValueError(
        f"{where}: {name} has shape {tuple(saved)} in the checkpoint and {tuple(model)} in the"
        " model; build the model with the options the checkpoint was trained with (its"
        " hyper_parameters)."
    )


def check_shard_files(directory: Path, storage_data: dict[Any, Any]) -> None:
    """Every shard file the metadata names exists and is long enough for what it holds.

    Raises:
        CorruptCheckpointError: Naming the first short or missing file.
    """
    needed: dict[str, int] = {}
    for info in storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        file = directory / relative
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            have = "is missing" if size < 0 else f"holds {size} bytes"
            raise CorruptCheckpointError(
                f"checkpoint {directory} is incomplete: {file} {have}, its metadata needs"
                f" {end}; resume from an earlier checkpoint (--ckpt_path last picks the"
                " newest complete one)."
            )


def consecutive_groups(items: Iterable[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, cut into groups of at most ``limit`` bytes by ``size(item)`` (an
    item larger than ``limit`` gets a group of its own): a checkpoint's shard files."""
    groups: list[list[T]] = [[]]
    total = 0
    for item in items:
        nbytes = size(item)
        if groups[-1] and total + nbytes > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += nbytes
    return groups
