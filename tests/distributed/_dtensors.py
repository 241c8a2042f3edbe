"""Whole tensors from a rank's DTensor shards, for comparing a sharded model with one
process. Reusable by every distributed test (``from _dtensors import full_params``)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def full(tensor: Tensor) -> Tensor:
    """A detached copy of the whole tensor a DTensor shards (gathered), or of ``tensor``."""
    tensor = tensor.detach()
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).clone()


def full_params(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter of ``module``, whole, detached and copied, by name."""
    return {n: full(p) for n, p in module.named_parameters()}


def full_grads(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient, whole and copied, by name. A ``Partial`` gradient (a
    replicated norm weight used on sequence or head shards) is summed over its ranks."""
    grads = {}
    for name, param in module.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.redistribute(param.device_mesh, param.placements).full_tensor()
        grads[name] = grad.clone()
    return grads
