"""MNIST-format IDX files: the four files of a split set, read and written with their
headers checked (numpy only: no torch, no Lightning)."""

from __future__ import annotations

import gzip
import shlex
from pathlib import Path

import numpy as np

from plugintrain.core.atomic_files import atomic_open

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


_UBYTE = 0x08


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write a uint8 array as an IDX file (magic ``0 0 8 ndim``, big-endian dims), atomically."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, _UBYTE, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    with atomic_open(path, shared=True) as f:
        f.write(header)
        f.write(array.tobytes())
    return Path(path)


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """Read a uint8 IDX file (plain or gzip-compressed) after checking its header.

    Args:
        path: The file; a ``.gz`` suffix means gzip.
        ndim: Expected number of dimensions (3 for images, 1 for labels).

    Raises:
        ValueError: If the magic, the number of dimensions or the data size is wrong.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    magic = tuple(raw[:4])
    if magic != (0, 0, _UBYTE, ndim):
        raise ValueError(f"{path}: bad IDX magic: expected {(0, 0, _UBYTE, ndim)}, found {magic}")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(shape)):
        raise ValueError(
            f"{path}: bad IDX data size for shape {shape}: expected {int(np.prod(shape))} "
            f"bytes, found {len(raw) - offset}"
        )
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(shape)


def find_idx(data_dir: str | Path, key: str) -> Path:
    """Path of one of the four `IDX_FILES` in ``data_dir``, plain or ``.gz``.

    Raises:
        FileNotFoundError: If neither exists; the message says how to create it.
    """
    base = Path(data_dir) / IDX_FILES[key]
    for candidate in (base, base.with_name(base.name + ".gz")):
        if candidate.exists():
            return candidate
    command = shlex.join(["plugintrain", "prepare", "mnist", "--out", str(data_dir)])
    raise FileNotFoundError(f"{base}[.gz] not found; create the MNIST files with `{command}`")


def load_split(data_dir: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) and labels (N,) of ``split`` (``"train"`` or ``"test"``), checked."""
    images = read_idx(find_idx(data_dir, f"{split}_images"), ndim=3)
    labels = read_idx(find_idx(data_dir, f"{split}_labels"), ndim=1)
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise ValueError(
            f"{data_dir}: {split} images {images.shape} and labels {labels.shape} do not "
            "describe N 28x28 images with N labels"
        )
    return images, labels
