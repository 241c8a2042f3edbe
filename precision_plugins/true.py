"""Single-dtype plugins: ``32-true`` and ``bf16-true``."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import HalfPrecision

from plugintrain.precision_plugins.base import LayoutAwarePrecision


class FP32Precision(LayoutAwarePrecision):
    """``32-true``: weights, activations, gradients and optimizer state in float32."""

    precision = "32-true"


class BF16TruePrecision(LayoutAwarePrecision, HalfPrecision):
    """``bf16-true``: weights (and so gradients and optimizer state) in bfloat16.

    Subclasses Lightning's ``HalfPrecision`` so Lightning's tools (the throughput
    monitor's peak-FLOP/s lookup) see the bf16 compute dtype.
    """

    def __init__(self) -> None:
        """Create the plugin; it has no options."""
        super().__init__("bf16-true")
