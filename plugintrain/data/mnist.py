"""MNIST-format image classification data: IDX files and a LightningDataModule."""

from __future__ import annotations

import gzip
import shlex
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from plugintrain.core.atomic_files import atomic_open
from plugintrain.data._pinning import pin_memory_for

# Mean and std of the MNIST training pixels scaled to [0, 1] (the torchvision constants).
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
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


class MNISTImages(Dataset):
    """Normalized ``(float image (1, 28, 28), int64 label)`` pairs from uint8 arrays.

    Args:
        images: uint8 images, shape (N, 28, 28).
        labels: Class labels, shape (N,).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.from_numpy(images.copy())
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = (self.images[i].float() / 255.0 - MNIST_MEAN) / MNIST_STD
        return image.unsqueeze(0), self.labels[i]


class MNISTDataModule(LightningDataModule):
    """MNIST (or Fashion-MNIST) from IDX files written by ``plugintrain prepare mnist``.

    The IDX training set is split into train and validation with a seeded permutation;
    the IDX test set is the test split.

    Args:
        data_dir: Directory with the four IDX files (plain or ``.gz``).
        batch_size: Images per batch (per process).
        val_fraction: Fraction of the IDX training set held out for validation.
        num_workers: DataLoader worker processes.
        seed: Seed of the train/validation split and of the training shuffle.
    """

    def __init__(
        self,
        data_dir: str = "data/mnist",
        batch_size: int = 64,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: MNISTImages | None = None
        self.val_set: MNISTImages | None = None
        self.test_set: MNISTImages | None = None
        for key in IDX_FILES:  # missing files stop `plugintrain fit` before it launches
            find_idx(self.data_dir, key)

    def setup(self, stage: str) -> None:
        """Load and split the IDX files needed by ``stage``."""
        if stage in ("fit", "validate") and self.train_set is None:
            images, labels = load_split(self.data_dir, "train")
            order = np.random.default_rng(self.seed).permutation(len(labels))
            n_val = max(1, round(len(labels) * self.val_fraction))
            val, train = order[:n_val], order[n_val:]
            self.train_set = MNISTImages(images[train], labels[train])
            self.val_set = MNISTImages(images[val], labels[val])
        if stage == "test" and self.test_set is None:
            self.test_set = MNISTImages(*load_split(self.data_dir, "test"))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (seeded)."""
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader(self.train_set, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in file order."""
        return self._loader(self.test_set, shuffle=False)

    def _loader(
        self, dataset: MNISTImages | None, shuffle: bool, generator: torch.Generator | None = None
    ) -> DataLoader:
        assert dataset is not None, "call setup() for this stage first"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            generator=generator,
            pin_memory=pin_memory_for(self.trainer),
        )
