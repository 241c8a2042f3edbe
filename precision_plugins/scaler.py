"""A dynamic loss scaler for float16 training, with explicit cross-rank agreement.

The state machine is the one of Micikevicius et al., "Mixed Precision Training" (2018):
multiply the loss by ``scale`` so small fp16 gradients do not flush to zero; if any
gradient overflowed, skip the step and back off; after ``growth_interval`` clean steps,
grow. Unlike ``torch.amp.GradScaler`` it does not track per-optimizer state: the caller
unscales, agrees found-inf across ranks, and reports the outcome with
:meth:`DynamicLossScaler.update`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class DynamicLossScaler:
    """Scale losses, unscale gradients, and adapt the scale to overflows.

    Args:
        init_scale: The first loss scale.
        growth_factor: Factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: Factor the scale shrinks by on a step with non-finite gradients.
        growth_interval: Consecutive clean steps needed before the scale grows.
        min_scale: The scale never backs off below this value.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"Need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor=}"
                f" and {backoff_factor=}."
            )
        if growth_interval < 1:
            raise ValueError(f"`growth_interval` must be >= 1, got {growth_interval}.")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss multiplied by the current scale (in fp32, where the loss lives)."""
        return loss * self.scale

    def unscale_(self, grads: Sequence[Tensor]) -> Tensor:
        """Divide ``grads`` by the scale in place; return 1.0 if any is non-finite, else 0.0.

        The flag is a float tensor on the first gradient's device, so it can be all-reduced
        with MAX on every backend.
        """
        found_inf: Tensor | None = None
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for grad in grads:
            by_device_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), group in by_device_dtype.items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
            # The fused kernel GradScaler uses: one pass that unscales and checks.
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale)
            flag = flag.squeeze()
            found_inf = flag if found_inf is None else torch.maximum(found_inf, flag.to(found_inf))
        return torch.zeros(()) if found_inf is None else found_inf

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow, or count a clean step and grow every interval."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters, for the checkpoint."""
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.scale = float(state_dict["scale"])
        self.clean_steps = int(state_dict["clean_steps"])
        self.skipped_steps = int(state_dict["skipped_steps"])
