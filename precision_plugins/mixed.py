"""Autocast plugins: ``bf16-mixed`` and ``16-mixed`` (float16 with dynamic loss scaling).

Both keep float32 master weights and optimizer state; autocast runs matmul-heavy ops
in low precision. They subclass Lightning's ``MixedPrecision`` so Lightning's tools
(the throughput monitor picks its compute dtype by class) keep working, but differ from
it in two ways:

- autocast's weight cache is on (Lightning >= 2.6 turns it off, lightning#20251), so
  each weight is cast once per forward rather than once per use; the no-grad case that
  motivated turning it off no longer loses gradients in torch >= 2.13.
- ``16-mixed`` stays float16 on CPU (Lightning silently switches it to bf16) and scales
  with :class:`DynamicLossScaler`, whose found-inf is agreed across the whole model.

A strategy that casts the weights itself turns autocast off (``autocast = False``, see
:class:`~plugintrain.core.contracts.AutocastSwitch`): FSDP2 with a ``MixedPrecisionPolicy``
gathers bf16 weights, and autocast would keep bf16 copies of its own beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from plugintrain.precision_plugins.base import LayoutAwarePrecision
from plugintrain.precision_plugins.scaler import DynamicLossScaler


def _device_type(model: Module) -> str | None:
    """Device type of the model's first materialized parameter (None if it has none)."""
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device.type
    return None


class _AutocastPrecision(LayoutAwarePrecision, MixedPrecision):
    """Autocast with the weight cache on, on the device the model lives on."""

    autocast: bool = True
    """Whether forwards run under autocast; off while the strategy casts the weights."""

    def __init__(self, precision: Literal["bf16-mixed", "16-mixed"], device: str | None) -> None:
        # MixedPrecision.__init__ is skipped on purpose: for fp16 it would build a torch
        # GradScaler, and ours scales by itself. `scaler = None` keeps MixedPrecision's
        # scaler-free code paths.
        self.precision = precision
        self.scaler = None
        self._device_from_model = device is None
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The autocast (compute) dtype."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        # Strategies move the model to its device before connecting the plugin.
        if self._device_from_model:
            self.device = _device_type(model) or self.device
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Skips MixedPrecision's refusal to clip for fused optimizers: that guards torch's
        # GradScaler, which leaves unscaling to them; our gradients are unscaled by now.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def autocast_context_manager(self) -> torch.autocast:
        # Disabled (rather than absent) when the strategy casts: nothing autocasts inside.
        return torch.autocast(
            self.device, dtype=self.dtype, enabled=self.autocast, cache_enabled=True
        )


class BF16MixedPrecision(_AutocastPrecision):
    """``bf16-mixed``: bfloat16 autocast, float32 master weights, optimizer state and loss.

    Args:
        device: Autocast device type (``"cpu"``, ``"cuda"``); None uses the device the
            strategy placed the model on.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__("bf16-mixed", device)


class FP16MixedPrecision(_AutocastPrecision):
    """``16-mixed``: float16 autocast with a dynamic loss scaler; float16 on CPU too.

    Overflowing steps are skipped on every rank together: found-inf is all-reduced over
    the strategy's gradient layout before the step. The scaler's state is saved in the
    checkpoint under this class's name.

    Args:
        device: Autocast device type (``"cpu"``, ``"cuda"``); None uses the device the
            strategy placed the model on.
        init_scale: The first loss scale.
        growth_factor: Factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: Factor the scale shrinks by on an overflowing (skipped) step.
        growth_interval: Consecutive clean steps before the scale grows.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__("16-mixed", device)
        self.loss_scaler = DynamicLossScaler(
            init_scale, growth_factor, backoff_factor, growth_interval
        )

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return super().pre_backward(self.loss_scaler.scale_loss(tensor), module)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise TypeError("16-mixed cannot step LBFGS: its closure re-runs unscaled backward.")
        self._bind_strategy(model)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, so nothing to unscale or step.
            self._after_closure(model, optimizer)
            return closure_result
        found_inf = self.unscale_and_check(optimizer)
        # Hooks and clipping see unscaled gradients, as with torch's GradScaler.
        self._after_closure(model, optimizer)
        self.loss_scaler.update(found_inf)
        if found_inf:
            return closure_result
        return optimizer.step(**kwargs)

    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients in place; whether any rank overflowed."""
        layout = self.gradient_layout(optimizer)
        return self.agree_found_inf(self.loss_scaler.unscale_(layout.grads()), layout)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.loss_scaler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_scaler.load_state_dict(state_dict)
