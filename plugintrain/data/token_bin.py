"""llm.c token files: a 256 x int32 header followed by the token ids.

Header fields: ``[0]`` magic 20240520, ``[1]`` version (1: uint16 tokens as for GPT-2,
2: uint32 tokens as for Llama 3), ``[2]`` token count; the rest is zero. This is the
interchange format of karpathy/llm.c (``dev/data/data_common.py``), so files written here
train there and vice versa.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from plugintrain.core.atomic_files import atomic_open

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# Little-endian on disk whatever the host, as llm.c writes them.
HEADER_DTYPE = np.dtype("<i4")
TOKEN_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file whose header or size does not describe a valid llm.c token file."""

    def __init__(self, path: str | Path, field: str, expected: object, actual: object) -> None:
        super().__init__(f"{path}: bad {field}: expected {expected}, found {actual}")
        self.path = Path(path)
        self.field = field


def write_token_bin(path: str | Path, tokens: np.ndarray | Sequence[int]) -> Path:
    """Write token ids as an llm.c token file, atomically.

    The version is the smallest that holds the largest id: 1 (uint16) below 65,536,
    else 2 (uint32).

    Args:
        path: Destination file; its directory is created if missing.
        tokens: Token ids, all in ``[0, 2**32)``.

    Returns:
        The path written.

    Raises:
        ValueError: If an id is negative or does not fit in uint32, or there are more
            tokens than the int32 count field can hold.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    version = _version_for(ids)
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[:3] = (MAGIC, version, ids.size)
    with atomic_open(path, shared=True) as f:
        f.write(header.tobytes())
        f.write(ids.astype(TOKEN_DTYPES[version]).tobytes())
    return Path(path)


def read_token_bin(path: str | Path) -> np.memmap:
    """Memory-map the tokens of an llm.c token file after checking its header.

    Args:
        path: The token file.

    Returns:
        A read-only 1-D memmap of uint16 (version 1) or uint32 (version 2) token ids.

    Raises:
        TokenFileError: If the magic, version or token count do not match the file.
    """
    path = Path(path)
    version, count = _read_header(path)
    dtype = TOKEN_DTYPES[version]
    expected_size = HEADER_BYTES + count * dtype.itemsize
    actual_size = path.stat().st_size
    if actual_size != expected_size:
        raise TokenFileError(
            path,
            f"file size for a token count of {count}",
            f"{expected_size} bytes",
            f"{actual_size} bytes",
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def _version_for(ids: np.ndarray) -> int:
    if ids.size >= 2**31:
        raise ValueError(f"{ids.size} tokens do not fit the int32 count field of a token file")
    if ids.size and ids.min() < 0:
        raise ValueError(f"token ids must be non-negative, found {ids.min()}")
    top = int(ids.max()) if ids.size else 0
    if top >= 2**32:
        raise ValueError(f"token id {top} does not fit in uint32")
    return 1 if top < 2**16 else 2


def _read_header(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise TokenFileError(path, "header size", f"{HEADER_BYTES} bytes", f"{len(raw)} bytes")
    header = np.frombuffer(raw, dtype=HEADER_DTYPE)
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise TokenFileError(path, "magic number", MAGIC, magic)
    if version not in TOKEN_DTYPES:
        raise TokenFileError(path, "version", f"one of {sorted(TOKEN_DTYPES)}", version)
    if count < 0:
        raise TokenFileError(path, "token count", "a non-negative count", count)
    return version, count
