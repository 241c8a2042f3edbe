"""safetensors written one tensor at a time (the library's writers take a whole dict).

The format is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range, then the raw bytes in that order. Shapes and dtypes are known
before any tensor is read, so the header goes first and each tensor is read, written and
dropped in turn: a converter never holds more than one tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from typing import IO

import torch
from torch import Tensor

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def write_safetensors(
    stream: IO[bytes],
    specs: Iterable[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    read: Callable[[str], Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file of the tensors ``specs`` (name, shape), each cast to
    ``dtype`` and read with ``read(name)`` only when its bytes are due.

    Raises:
        ValueError: If a tensor read has another shape than its spec said.
    """
    specs = list(specs)
    width = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        size = math.prod(shape) * width
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    stream.write(struct.pack("<Q", len(text)) + text)
    for name, shape in specs:
        tensor = read(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, read {tuple(tensor.shape)}")
        stream.write(tensor.to(dtype).contiguous().view(-1).view(torch.uint8).numpy().data)
