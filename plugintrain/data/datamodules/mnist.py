"""MNIST-format image classification data: a dataset over IDX files, a LightningDataModule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from plugintrain.data.datamodules._pinning import pin_memory_for
from plugintrain.data.idx import IDX_FILES, find_idx, load_split

# Mean and std of the MNIST training pixels scaled to [0, 1] (the torchvision constants).
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


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
