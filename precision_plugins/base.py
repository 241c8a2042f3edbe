"""Mesh awareness shared by every plugintrain precision plugin.

Gradient clipping and found-inf need the whole model's gradients, which may be split
over tensor, pipeline and data-parallel ranks. The strategy describes that split through
:class:`plugintrain.core.contracts.GradientLayoutProvider`; these plugins consume it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.core.contracts import (
    CountsTargets,
    GradientLayout,
    GradientLayoutProvider,
    default_gradient_layout,
)


def clip_grads_by_global_norm_(layout: GradientLayout, max_norm: float) -> Tensor:
    """Scale the layout's gradients in place so their global L2 norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``, so a sharded model clips exactly
    like its single-process reference.

    Returns:
        The global norm before clipping.
    """
    total_norm = layout.global_norm()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in layout.grads():
        grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return total_norm


def mean_over_targets_(layout: GradientLayout, counts: Tensor) -> float:
    """Rescale the layout's gradients, in place, to the mean over the global batch's
    scored targets (see :class:`~plugintrain.core.contracts.CountsTargets`).

    Every rank of the layout's group adds its ``(scored, positions)``; tensor-parallel
    peers and pipeline stages count the same batch, which changes both sums alike and so
    not their ratio.

    Returns:
        The factor applied: ``positions / scored`` (1 when no target was scored: the
        gradients then hold no token loss to average).
    """
    total = layout.all_reduce(counts.to(layout.device, torch.float64).clone(), dist.ReduceOp.SUM)
    scored, positions = total.tolist()
    factor = positions / scored if scored > 0 else 1.0
    if factor != 1.0:
        for grad in layout.grads():
            grad.mul_(factor)
    return factor


class LayoutAwarePrecision(Precision):
    """Clip by the global norm over every shard and stage, and agree found-inf across them.

    The layout comes from the trainer's strategy when it implements
    :class:`~plugintrain.core.contracts.GradientLayoutProvider` (bound at each optimizer step),
    else from :func:`~plugintrain.core.contracts.default_gradient_layout` (one process, DDP,
    DTensor sharding over the whole world). Combine it with a Lightning plugin class by
    listing it first among the bases.
    """

    layout_provider: GradientLayoutProvider | None = None

    def gradient_layout(self, optimizer: Optimizer) -> GradientLayout:
        """The layout of the gradients ``optimizer`` steps."""
        params = list(self.main_params(optimizer))
        if self.layout_provider is not None:
            return self.layout_provider.gradient_layout(params)
        return default_gradient_layout(params)

    def agree_found_inf(self, found_inf: Tensor, layout: GradientLayout) -> bool:
        """Whether any rank of the layout's group found a non-finite gradient.

        Every rank of the group must call this, so all of them skip the same steps.
        """
        flag = found_inf.detach().to(device=layout.device, dtype=torch.float32).clone()
        return bool(layout.all_reduce(flag, dist.ReduceOp.MAX).item())

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Optimizer) -> None:
        # Gradients of a masked loss become the mean over the step's scored targets before
        # any hook, clipping or the optimizer sees them.
        counts = model.take_target_counts() if isinstance(model, CountsTargets) else None
        if counts is not None:
            mean_over_targets_(self.gradient_layout(optimizer), counts)
        super()._after_closure(model, optimizer)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grads_by_global_norm_(self.gradient_layout(optimizer), float(clip_val))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        self._bind_strategy(model)
        return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    def _bind_strategy(self, model: pl.LightningModule) -> None:
        # Lightning hands plugins the module, not the strategy; the module knows its trainer.
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and isinstance(trainer.strategy, GradientLayoutProvider):
            self.layout_provider = trainer.strategy
