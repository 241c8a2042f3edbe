"""MNISTClassifier: a small MLP or CNN for 28x28 digit images, the framework's smoke test."""

import itertools
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from plugintrain.checkpoints.portable import PortableCheckpoints

_NUM_CLASSES = 10


def _mlp(hidden_sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]  # (B, 1, 28, 28) -> (B, 784)
    sizes = [28 * 28, *hidden_sizes]
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    layers.append(nn.Linear(sizes[-1], _NUM_CLASSES))
    return nn.Sequential(*layers)


def _cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),  # (B, 16, 28, 28)
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 16, 14, 14)
        nn.Conv2d(16, 32, kernel_size=3, padding=1),  # (B, 32, 14, 14)
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 32, 7, 7)
        nn.Flatten(),  # (B, 1568)
        nn.Linear(32 * 7 * 7, _NUM_CLASSES),
    )


class MNISTClassifier(PortableCheckpoints, L.LightningModule):
    """Classifies 28x28 grayscale digits into 10 classes.

    Args:
        arch: ``mlp`` (784 -> hidden_sizes -> 10 with ReLU) or ``cnn`` (two 3x3 conv +
            max-pool stages, 16 and 32 channels, then one Linear layer).
        hidden_sizes: Hidden layer widths of the MLP; ignored by the CNN. The default
            (128, 64) is the classic small MNIST MLP (109,386 parameters).
        optimizer: Builds the optimizer from the parameters, e.g. ``torch.optim.Adam``.
    """

    def __init__(
        self,
        arch: str = "mlp",
        hidden_sizes: Sequence[int] = (128, 64),
        optimizer: OptimizerCallable = torch.optim.Adam,
    ) -> None:
        super().__init__()
        if arch not in ("mlp", "cnn"):
            raise ValueError(f"Unknown arch={arch!r}; choose 'mlp' or 'cnn'.")
        self.save_hyperparameters()
        self.net = _mlp(hidden_sizes) if arch == "mlp" else _cnn()
        self.optimizer = optimizer
        # micro: the plain fraction of correct predictions (torchmetrics defaults to macro).
        self.train_acc = MulticlassAccuracy(_NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(_NUM_CLASSES, average="micro")
        self.test_acc = MulticlassAccuracy(_NUM_CLASSES, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, 10)`` for normalized images ``(B, 1, 28, 28)``."""
        return self.net(images)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """Logs ``train_loss`` and ``train_acc``."""
        return self._step(batch, "train", self.train_acc)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val_loss`` and ``val_acc``."""
        self._step(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``test_loss`` and ``test_acc``."""
        self._step(batch, "test", self.test_acc)

    def _step(
        self, batch: tuple[torch.Tensor, torch.Tensor], stage: str, accuracy: MulticlassAccuracy
    ) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        accuracy(logits, labels)
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=stage != "train")
        self.log(f"{stage}_acc", accuracy, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The injected optimizer over all parameters."""
        return self.optimizer(self.parameters())
