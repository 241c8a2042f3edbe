"""Model zoo: single-device models and LightningModules (installed as plugintrain.model_zoo).

Importing the package registers the presets of every family (``gpt2``, ``llama3``, ``qwen3``,
``deepseek_v3``, ``qwen3_moe``: :mod:`plugintrain.model_zoo.families`). The LightningModules
(:class:`CausalLM`, :class:`MNISTClassifier`) are imported on first use, so the plain
PyTorch models and configs load without Lightning.
"""

from typing import TYPE_CHECKING, Any

from plugintrain.model_zoo import deepseek_v3, gpt2, llama3, qwen3, qwen3_moe
from plugintrain.model_zoo.config import MLAConfig, MoEConfig, RopeScaling, TransformerConfig
from plugintrain.model_zoo.transformer import Transformer

if TYPE_CHECKING:
    from plugintrain.model_zoo.lm import CausalLM
    from plugintrain.model_zoo.mnist import MNISTClassifier

_LIGHTNING_MODULES = {
    "CausalLM": "plugintrain.model_zoo.lm",
    "MNISTClassifier": "plugintrain.model_zoo.mnist",
}

__all__ = [
    "CausalLM",
    "MLAConfig",
    "MNISTClassifier",
    "MoEConfig",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "deepseek_v3",
    "gpt2",
    "llama3",
    "qwen3",
    "qwen3_moe",
]


def __getattr__(name: str) -> Any:
    """The LightningModules, imported (with Lightning) when first asked for (PEP 562)."""
    if name in _LIGHTNING_MODULES:
        import importlib

        return getattr(importlib.import_module(_LIGHTNING_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
