"""Model zoo: single-device models and LightningModules (installed as plugintrain.model_zoo).

Importing the package registers the presets of every family (``gpt2``, ``llama3``, ``qwen3``).
"""

from plugintrain.model_zoo import gpt2, llama3, qwen3
from plugintrain.model_zoo.config import RopeScaling, TransformerConfig
from plugintrain.model_zoo.lm import CausalLM
from plugintrain.model_zoo.mnist import MNISTClassifier
from plugintrain.model_zoo.transformer import Transformer

__all__ = [
    "CausalLM",
    "MNISTClassifier",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "gpt2",
    "llama3",
    "qwen3",
]
