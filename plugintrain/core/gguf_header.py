"""The header of a GGUF file: its key-value metadata, and where each tensor lies, read
without touching the tensors.

``gguf.GGUFReader`` parses every string of a vocabulary into numpy views (about 5 s for a
49k-token vocabulary); a tokenizer needs only the metadata, which this reads in one pass
over the header with :mod:`struct` (a few hundred milliseconds). Layout: the GGUF spec,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import Keys

GGUF_MAGIC = b"GGUF"

TOKENIZER_KEYS = Keys.Tokenizer
"""The ``tokenizer.*`` metadata keys (``TOKENIZER_KEYS.LIST`` is ``tokenizer.ggml.tokens``), as
the ``gguf`` package, llama.cpp's own, names them: the one spelling the GGUF writer and both
readers of a GGUF's tokenizer use."""

# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file and its value.

    Strings are ``str``, arrays of strings ``list[str]``, numeric arrays 1-D numpy arrays
    and scalars Python numbers.

    Raises:
        ValueError: If the file is not a little-endian GGUF file of version 2 or 3, or its
            header is cut short.
    """
    with open(path, "rb") as f:
        return _read_metadata(f, path)[0]


def _read_metadata(f: BinaryIO, path: str | Path) -> tuple[dict[str, Any], int]:
    """The metadata, and the number of tensors the table after it describes."""
    try:
        magic, version = f.read(4), _unpack(f, "<I")
    except struct.error:
        raise ValueError(f"{path}: not a GGUF file (shorter than its header)") from None
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(
            f"{path}: not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})"
        )
    try:
        tensor_count, kv_count = _unpack(f, "<Q"), _unpack(f, "<Q")
        metadata = {_read_string(f): _read_value(f, _unpack(f, "<I")) for _ in range(kv_count)}
    except (struct.error, UnicodeDecodeError, KeyError) as error:
        raise ValueError(f"{path}: GGUF metadata is cut short or corrupt ({error})") from None
    return metadata, tensor_count


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in a GGUF file."""

    name: str
    shape: tuple[int, ...]
    """In numpy (row-major) order: GGUF lists dimensions innermost first."""
    type_id: int
    """The ``ggml_type`` (``gguf.GGMLQuantizationType`` value)."""
    offset: int
    """Byte offset of its data from the start of the file."""


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """Every metadata key of a GGUF file with its value, and every tensor's
    :class:`GGUFTensorInfo` (data offsets from the start of the file, aligned as the file
    says, 32 bytes by default).

    Raises:
        ValueError: As :func:`read_gguf_metadata`, also for a cut-short tensor table.
    """
    with open(path, "rb") as f:
        metadata, count = _read_metadata(f, path)
        try:
            infos = [_read_tensor_info(f) for _ in range(count)]
        except (struct.error, UnicodeDecodeError) as error:
            raise ValueError(
                f"{path}: GGUF tensor table is cut short or corrupt ({error})"
            ) from None
        alignment = int(metadata.get("general.alignment", 32))
        start = math.ceil(f.tell() / alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, type_id, start + offset)
        for name, shape, type_id, offset in infos
    }
    return metadata, tensors


def _read_tensor_info(f: BinaryIO) -> tuple[str, tuple[int, ...], int, int]:
    name = _read_string(f)
    dims = [_unpack(f, "<Q") for _ in range(_unpack(f, "<I"))]
    return name, tuple(reversed(dims)), _unpack(f, "<I"), _unpack(f, "<Q")


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def _read_string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "<Q")).decode("utf-8")


def _read_value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _read_string(f)
    if kind == _ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item == _STRING:
            return [_read_string(f) for _ in range(count)]
        if item == _ARRAY:
            return [_read_value(f, _ARRAY) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item][1])
        data = f.read(dtype.itemsize * count)
        if len(data) != dtype.itemsize * count:
            raise struct.error(f"array of {count} x {dtype} ends early")
        return np.frombuffer(data, dtype=dtype)
    return _unpack(f, _SCALARS[kind][0])
