"""Lightning precision plugins for plugintrain (installed as plugintrain.precision_plugins).

Select one in a recipe by class path, or build it from its short name::

    trainer:
      plugins:
        - class_path: plugintrain.precision_plugins.FP16MixedPrecision
          init_args: {growth_interval: 1000}

    precision_plugin_from_name("bf16-mixed")
"""

from plugintrain.precision_plugins.base import LayoutAwarePrecision, clip_grads_by_global_norm_
from plugintrain.precision_plugins.mixed import BF16MixedPrecision, FP16MixedPrecision
from plugintrain.precision_plugins.registry import (
    PRECISION_PLUGINS,
    PrecisionDtypes,
    canonical_precision_name,
    precision_dtypes,
    precision_plugin_from_name,
)
from plugintrain.precision_plugins.scaler import DynamicLossScaler
from plugintrain.precision_plugins.true import BF16TruePrecision, FP32Precision

__all__ = [
    "PRECISION_PLUGINS",
    "BF16MixedPrecision",
    "BF16TruePrecision",
    "DynamicLossScaler",
    "FP16MixedPrecision",
    "FP32Precision",
    "LayoutAwarePrecision",
    "PrecisionDtypes",
    "canonical_precision_name",
    "clip_grads_by_global_norm_",
    "precision_dtypes",
    "precision_plugin_from_name",
]
