"""A transformer from a preset, a config or pretrained weights, without Lightning: what
:class:`~plugintrain.model_zoo.CausalLM` builds, and what ``plugintrain generate`` samples
from. Weights are opened through :mod:`plugintrain.core.pretrained` (implemented by
:mod:`plugintrain.formats`): any format, loaded into the parts of the model a rank holds."""

from __future__ import annotations

import torch

from plugintrain.core.pretrained import open_pretrained
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.transformer import Transformer


def build_transformer(config: TransformerConfig, weights: str | None) -> Transformer:
    """The transformer, randomly initialized, or holding the pretrained ``weights``.

    Pretrained: built on meta and allocated without drawing random values; under a
    strategy's meta-device context the strategy allocates it, then calls ``init_weights``.
    """
    if weights is None:
        return Transformer(config)
    device = torch.empty(()).device
    with torch.device("meta"):
        model = Transformer(config)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_buffers()
        load_pretrained(model, config, weights)
    return model


def load_pretrained(model: Transformer, config: TransformerConfig, weights: str) -> None:
    """Copy the pretrained ``weights`` into the parts of ``model`` this rank holds."""
    open_pretrained(weights).load_into(model, config)


def resolve_config(
    config: str | dict | TransformerConfig | None, weights: str | None
) -> TransformerConfig:
    """The architecture: ``config`` (a preset name, fields or a config), else the one the
    ``weights`` file describes, with the tokenizer that came with it."""
    if isinstance(config, dict):  # saved as its fields (PortableCheckpoints)
        config = TransformerConfig.from_dict(config)
    elif isinstance(config, str):
        config = TransformerConfig.from_name(config)
    if weights is None:
        return config or TransformerConfig.from_name("gpt2-debug")
    found = open_pretrained(weights)
    if config is not None:
        found.check_architecture(config)
        return config
    return found.config
