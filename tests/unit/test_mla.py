"""Multi-head latent attention against transformers' ``DeepseekV3Attention``, its latent
KV cache against the full forward, and its config checks.

The reference layer is built by ``transformers`` from a config spelled out field by field
(random weights, nothing downloaded), with its own rotary embedding and an explicit
causal mask; its weights are copied into ours by module name.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from plugintrain.model_zoo import CausalLM, MLAConfig, Transformer, TransformerConfig
from plugintrain.model_zoo.layers import rope_cache
from plugintrain.model_zoo.mla import LatentKVCache, MultiHeadLatentAttention

from _hf_models import randomize_

# Our module -> DeepseekV3Attention's (DeepSeek's checkpoint names).
HF_MODULES = {
    "wq": "q_proj", "wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}  # fmt: skip


def _config(
    q_lora_rank: int | None = 48, rope_interleave: bool = True, norm_eps: float = 1e-6
) -> TransformerConfig:
    mla = MLAConfig(kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=24, rope_interleave=rope_interleave)  # fmt: skip
    return TransformerConfig.from_name(
        "deepseek-v3-debug", vocab_size=96, block_size=64, n_layer=2, n_embd=64, mla=mla,
        norm_eps=norm_eps, tokenizer=None,
    )  # fmt: skip


def _hf_config(config: TransformerConfig) -> transformers.DeepseekV3Config:
    mla = config.mla
    hf = transformers.DeepseekV3Config(
        hidden_size=config.n_embd, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_head, kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        rope_interleave=mla.rope_interleave, max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )  # fmt: skip
    hf._attn_implementation = "eager"
    return hf


@torch.no_grad()
def _ours_from(hf: DeepseekV3Attention, config: TransformerConfig) -> MultiHeadLatentAttention:
    ours = MultiHeadLatentAttention(config).eval()
    for name, param in ours.named_parameters():
        module = name.removesuffix(".weight")
        param.copy_(hf.get_parameter(f"{HF_MODULES[module]}.weight"))
    return ours


VARIANTS = {
    "query-latent-interleaved": (48, True),
    "query-latent-halves": (48, False),
    "direct-query-interleaved": (None, True),
    "direct-query-halves": (None, False),
    # The blocks' norms take rms_norm_eps; the latent norms keep DeepSeek's 1e-6.
    "block-norm-eps": (48, True, 0.1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_equals_transformers_forward_and_backward(variant: str) -> None:
    """Outputs and every gradient, for a query latent or none, both RoPE layouts, and a
    model whose blocks' norms have another epsilon than the latent norms."""
    config = _config(*VARIANTS[variant])
    hf_config = _hf_config(config)
    torch.manual_seed(0)
    hf = randomize_(DeepseekV3Attention(hf_config, layer_idx=0), seed=1)
    ours = _ours_from(hf, config)
    B, T = 2, 10
    x = torch.randn(B, T, config.n_embd, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    position_ids = torch.arange(T)[None].expand(B, -1)
    hf_rope = DeepseekV3RotaryEmbedding(hf_config)(x, position_ids)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # (1, 1, T, T)
    y_hf = hf(x_hf, position_embeddings=hf_rope, attention_mask=causal)[0]
    cos, sin = rope_cache(config)
    y_ours = ours(x_ours, (cos[:T], sin[:T]))
    torch.testing.assert_close(y_ours, y_hf, atol=1e-5, rtol=1e-5)
    probe = torch.randn(y_hf.shape, generator=torch.Generator().manual_seed(3))
    (y_hf * probe).sum().backward()
    (y_ours * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=1e-5)
    for name, param in ours.named_parameters():
        theirs = hf.get_parameter(f"{HF_MODULES[name.removesuffix('.weight')]}.weight")
        torch.testing.assert_close(param.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def test_cache_holds_only_the_latent_and_the_shared_rope_key() -> None:
    """Per token and layer: ``kv_lora_rank + qk_rope_head_dim`` = 40 numbers, against the
    4 heads x (24 key + 24 value) = 192 a cache of the expanded keys and values would."""
    model = Transformer(_config())
    model.setup_kv_cache(batch_size=2, max_seq_len=16)
    for layer in model.layers.values():
        cache = layer.attention.kv_cache
        assert isinstance(cache, LatentKVCache)
        assert {n: tuple(b.shape) for n, b in cache.named_buffers()} == {
            "latent": (2, 16, 32),
            "k_rope": (2, 1, 16, 8),
        }
    assert not any("cache" in name for name in model.state_dict())


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_decode_logits_equal_the_full_forward(variant: str) -> None:
    torch.manual_seed(0)
    model = randomize_(Transformer(_config(*VARIANTS[variant])), seed=1)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens)
        model.setup_kv_cache(2, 16)
        prefill = model(tokens[:, :6], torch.arange(6))
        decoded = [model(tokens[:, t : t + 1], torch.tensor([t])) for t in range(6, 9)]
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *decoded], dim=1), expected)


@pytest.mark.parametrize("preset", ["deepseek-v3-debug", "qwen3-moe-debug"])
def test_cached_greedy_generation_equals_uncached(preset: str) -> None:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(preset, vocab_size=96, block_size=32, n_layer=2)
    lm = CausalLM(config)
    lm.configure_model()
    randomize_(lm.model, seed=1)
    lm.eval()
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = lm.generate(prompt, max_new_tokens=12, temperature=0.0)
    uncached = lm.generate(prompt, max_new_tokens=12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("mla", "message"),
    [
        ({"kv_lora_rank": 256, "q_lora_rank": None},
         r"MLA ranks \{'kv_lora_rank': 256\} are larger than the model width n_embd=128"),
        ({"kv_lora_rank": 32, "q_lora_rank": 512},
         r"MLA ranks \{'q_lora_rank': 512\} are larger than the model width n_embd=128"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 is odd"),
        ({"v_head_dim": 0}, r"\{'v_head_dim': 0\}"),
    ],
    ids=["kv_lora_rank", "q_lora_rank", "odd-rope", "zero-value"],
)  # fmt: skip
def test_bad_latent_sizes_are_one_line_naming_the_value(mla: dict, message: str) -> None:
    fields = {
        "name": "bad", "family": "deepseek_v3", "vocab_size": 96, "block_size": 64,
        "n_layer": 1, "n_head": 4, "n_embd": 128, "norm": "rmsnorm", "mlp": "swiglu",
        "position": "rope", "bias": False, "attention": "mla", "mla": mla,
    }  # fmt: skip
    with pytest.raises(ValueError, match=message) as info:
        TransformerConfig.from_dict(fields)
    assert "\n" not in str(info.value)


def test_attention_and_its_shape_come_together() -> None:
    with pytest.raises(ValueError, match="attention='gqa' with mla=MLAConfig"):
        TransformerConfig.from_name("deepseek-v3-debug", attention="gqa")
    with pytest.raises(ValueError, match="attention='mla' with mla=None"):
        TransformerConfig.from_name("llama3-debug", attention="mla")
