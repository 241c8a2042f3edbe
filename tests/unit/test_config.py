"""TransformerConfig: presets, parameter counts, validation."""

import dataclasses

import pytest
import torch

from plugintrain.model_zoo import RopeScaling, Transformer, TransformerConfig


def _meta_param_count(config: TransformerConfig) -> int:
    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() for p in model.parameters())  # tied weights count once


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2-124m", 124_439_808),
        ("llama3.2-1b", 1_235_814_400),
        ("llama3.2-3b", 3_212_749_824),
        ("llama3.1-8b", 8_030_261_248),
        ("llama3.1-70b", 70_553_706_496),
        ("llama3.1-405b", 405_853_388_800),
    ],
)
def test_published_parameter_counts(name, expected):
    assert _meta_param_count(TransformerConfig.from_name(name)) == expected


@pytest.mark.parametrize("name", TransformerConfig.presets())
def test_analytic_count_matches_built_model(name):
    config = TransformerConfig.from_name(name)
    assert config.num_params() == _meta_param_count(config)


def test_every_family_has_a_debug_preset():
    assert {"gpt2-debug", "llama3-debug", "qwen3-debug"} <= set(TransformerConfig.presets())


def test_non_embedding_count_is_nanogpt_convention():
    # nanoGPT reports 123.65M for GPT-2 small: all weights except the position table.
    assert TransformerConfig.from_name("gpt2-124m").num_params(include_embeddings=False) == (
        124_439_808 - 1024 * 768
    )


def test_flops_per_token_formula():
    config = TransformerConfig.from_name("gpt2-124m")
    n = config.num_params(include_embeddings=False)
    assert config.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024


def test_resolved_properties():
    config = TransformerConfig.from_name("llama3.2-1b")
    assert (config.head_dim, config.kv_heads, config.ffn_dim) == (64, 8, 8192)
    gpt2 = TransformerConfig.from_name("gpt2-124m")
    assert (gpt2.head_dim, gpt2.kv_heads, gpt2.ffn_dim) == (64, 12, 3072)


def test_from_name_applies_overrides_and_keeps_preset():
    config = TransformerConfig.from_name("gpt2-debug", n_layer=2, vocab_size=64)
    assert (config.n_layer, config.vocab_size) == (2, 64)
    assert TransformerConfig.from_name("gpt2-debug").n_layer == 4


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="gpt2-124m") as info:
        TransformerConfig.from_name("gpt5-huge")
    assert "llama3.2-1b" in str(info.value)


def test_unknown_override_field():
    with pytest.raises(ValueError, match="n_layers"):
        TransformerConfig.from_name("gpt2-debug", n_layers=2)


@pytest.mark.parametrize(
    ("overrides", "quoted"),
    [
        ({"n_embd": 130}, "n_embd=130"),
        ({"n_kv_head": 3}, "n_kv_head=3"),
        ({"norm": "batchnorm"}, "'batchnorm'"),
        ({"mlp": "relu"}, "'relu'"),
        ({"position": "alibi"}, "'alibi'"),
        ({"n_layer": 0}, "'n_layer': 0"),
        ({"vocab_size": -1}, "'vocab_size': -1"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"n_embd": 132, "n_head": 4, "n_kv_head": 2}, "head_dim=33"),
        ({"position": "learned"}, "position='learned'"),  # llama3-debug has rope_scaling
    ],
)
def test_invalid_configs_quote_values(overrides, quoted):
    with pytest.raises(ValueError) as info:
        TransformerConfig.from_name("llama3-debug", **overrides)
    assert quoted in str(info.value)


def test_invalid_rope_scaling():
    with pytest.raises(ValueError, match=r"high_freq_factor=1\.0"):
        RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)


def test_presets_are_not_shared_mutable_state():
    config = TransformerConfig.from_name("gpt2-debug")
    config.n_layer = 1
    assert TransformerConfig.from_name("gpt2-debug").n_layer == 4
    assert dataclasses.replace(config, n_layer=2).n_layer == 2
