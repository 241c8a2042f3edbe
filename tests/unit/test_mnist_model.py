"""MNISTClassifier: shapes and a few training steps."""

import pytest
import torch

from plugintrain.model_zoo import MNISTClassifier


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_forward_shape(arch):
    model = MNISTClassifier(arch=arch)
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)


def test_custom_hidden_sizes():
    model = MNISTClassifier(hidden_sizes=[32])
    widths = [m.out_features for m in model.net if isinstance(m, torch.nn.Linear)]
    assert widths == [32, 10]


def test_unknown_arch_raises():
    with pytest.raises(ValueError, match="'rnn'"):
        MNISTClassifier(arch="rnn")


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_steps_reduce_loss(arch):
    torch.manual_seed(0)
    model = MNISTClassifier(arch=arch)
    optimizer = model.configure_optimizers()
    images, labels = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(25):  # memorizing random labels: slow but steady
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
