"""Model zoo: single-device models and LightningModules (installed as plugintrain.model_zoo).

Importing the package registers the presets of every family (``gpt2``, ``llama3``, ``qwen3``,
``deepseek_v3``, ``qwen3_moe``: :mod:`plugintrain.model_zoo.families`). Every other name is
imported from its module on first use (PEP 562): the LightningModules (:class:`CausalLM`,
:class:`MNISTClassifier`) load Lightning, the plain PyTorch models and configs do not.
"""

from plugintrain.core.lazy import lazy_exports
from plugintrain.model_zoo import families  # noqa: F401 (imports every family: its presets)

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "config": ("MLAConfig", "MoEConfig", "RopeScaling", "TransformerConfig"),
        "families": ("deepseek_v3", "gpt2", "llama3", "qwen3", "qwen3_moe"),
        "lm": ("CausalLM",),
        "mnist": ("MNISTClassifier",),
        "preference": ("PreferenceLM",),
        "rl": ("GRPOLM",),
        "transformer": ("Transformer",),
    },
)
