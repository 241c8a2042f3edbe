"""Short names for the precision plugins, as ``Trainer(precision=...)`` spells them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from plugintrain.precision_plugins.mixed import BF16MixedPrecision, FP16MixedPrecision
from plugintrain.precision_plugins.true import BF16TruePrecision, FP32Precision

PRECISION_PLUGINS: dict[str, type[Precision]] = {
    "32-true": FP32Precision,
    "bf16-true": BF16TruePrecision,
    "bf16-mixed": BF16MixedPrecision,
    "16-mixed": FP16MixedPrecision,
}

# Lightning's shorthands for the same settings.
_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def canonical_precision_name(name: str | int | None) -> str | None:
    """The registered name for ``name`` (resolving Lightning's shorthands), or None."""
    key = _ALIASES.get(str(name), str(name))
    return key if key in PRECISION_PLUGINS else None


def precision_plugin_from_name(name: str | int, **kwargs: Any) -> Precision:
    """Build the plugin registered as ``name`` (or a Lightning shorthand: 32, 16, bf16).

    Args:
        name: One of :data:`PRECISION_PLUGINS`'s keys or a shorthand.
        **kwargs: The plugin's init arguments (e.g. ``growth_interval`` for ``16-mixed``).

    Raises:
        ValueError: If ``name`` is not registered.
    """
    key = canonical_precision_name(name)
    if key is None:
        raise ValueError(
            f"Unknown precision {name!r}; choose one of {', '.join(PRECISION_PLUGINS)}."
        )
    return PRECISION_PLUGINS[key](**kwargs)


@dataclass(frozen=True)
class PrecisionDtypes:
    """The dtypes a precision setting trains in."""

    compute: torch.dtype
    """What the matmuls run in: autocast's dtype under ``*-mixed``, the weights' otherwise."""
    params: torch.dtype
    """The weights' (master) dtype, and so the residual stream's between layers."""

    @property
    def mixed(self) -> bool:
        """Whether weights are kept in a wider dtype than the one computed in."""
        return self.compute != self.params


_DTYPES = {
    "64-true": (torch.float64, torch.float64),
    "32-true": (torch.float32, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
}


def precision_dtypes(plugin: Precision) -> PrecisionDtypes:
    """The compute and weight dtypes of any Lightning precision plugin (ours or Lightning's),
    by its ``precision`` name; a setting not listed here (``transformer-engine``) counts as
    fp32, the dtype its weights and activations keep between layers."""
    key = canonical_precision_name(plugin.precision) or str(plugin.precision)
    compute, params = _DTYPES.get(key, (torch.float32, torch.float32))
    return PrecisionDtypes(compute, params)
