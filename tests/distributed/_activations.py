"""The activation memory of one training step, measured by something that sees every tensor."""

from __future__ import annotations

import torch

from plugintrain.core.memory import LiveTensorMemory


def step_activation_peak(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak bytes of one forward and backward of ``module`` (a ``CausalLM``) on ``x``, ``y``
    beyond what lived before it: the weights, their gradients (from a first step run here,
    so that backward adds into them in place) and the batch."""
    module.loss_fn(module(x), y).backward()
    with LiveTensorMemory() as memory:
        memory.track(module.parameters(), [p.grad for p in module.parameters()])
        memory.track(module.buffers(), x, y)
        before = memory.live_bytes
        module.loss_fn(module(x), y).backward()
    return memory.peak_bytes - before
