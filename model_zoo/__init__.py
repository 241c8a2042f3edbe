"""Model zoo: single-device models and LightningModules (installed as plugintrain.model_zoo).

Importing the package registers the presets of every family (``gpt2``, ``llama3``, ``qwen3``,
``deepseek_v3``, ``qwen3_moe``).
"""

from plugintrain.model_zoo import deepseek_v3, gpt2, llama3, qwen3, qwen3_moe
from plugintrain.model_zoo.config import MLAConfig, MoEConfig, RopeScaling, TransformerConfig
from plugintrain.model_zoo.lm import CausalLM
from plugintrain.model_zoo.mnist import MNISTClassifier
from plugintrain.model_zoo.transformer import Transformer

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
