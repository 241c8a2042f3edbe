"""How many bytes of text each token id stands for: the seam between data and models for
bits per byte.

Loss per token depends on the tokenizer; loss per byte of text does not, so models with
different vocabularies compare on bits per byte. ``plugintrain prepare`` writes the table
beside the token files; a datamodule that offers it is a :class:`TokenBytesSource`, which
is all a model needs to know (models import no datamodule).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plugintrain.core.atomic_files import atomic_open

TOKEN_BYTES_FILE = "token_bytes.npy"
"""File name of the table, beside ``train.bin``/``val.bin``: int32, one entry per id."""


def write_token_bytes(data_dir: str | Path, counts: np.ndarray) -> Path:
    """Write the bytes-per-id table into ``data_dir``, atomically."""
    path = Path(data_dir) / TOKEN_BYTES_FILE
    with atomic_open(path, shared=True) as f:
        np.save(f, np.asarray(counts, dtype=np.int32), allow_pickle=False)
    return path


def read_token_bytes(data_dir: str | Path) -> np.ndarray | None:
    """The bytes-per-id table in ``data_dir``; None when there is none.

    Raises:
        ValueError: If the file is not a 1-D integer array (nothing in it is unpickled).
    """
    path = Path(data_dir) / TOKEN_BYTES_FILE
    if not path.is_file():
        return None
    counts = np.load(path, allow_pickle=False)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: expected a 1-D integer array of bytes per token id, got"
            f" {counts.dtype} of shape {counts.shape}; rebuild it with `plugintrain prepare`"
        )
    return counts
