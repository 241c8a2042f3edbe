"""Llama 3 (Grattafiori et al. 2024): presets, Hugging Face weight adapter, tensor-parallel plan."""

import re

import torch

from plugintrain.model_zoo import gpt2
from plugintrain.model_zoo.config import RopeScaling, TransformerConfig, register_preset

# Llama 3.2 extends the 8k pretraining context to 128k with a 32x frequency scaling.
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(name: str, **sizes: int | bool | RopeScaling) -> None:
    defaults = dict(
        family="llama3",
        vocab_size=128256,
        block_size=131072,
        bias=False,
        norm="rmsnorm",
        norm_eps=1e-5,
        mlp="swiglu",
        position="rope",
        rope_theta=500000.0,
    )
    register_preset(TransformerConfig(name=name, **(defaults | sizes)))


_llama3(
    "llama3.2-1b",
    n_layer=16,
    n_head=32,
    n_kv_head=8,
    n_embd=2048,
    intermediate_size=8192,
    tie_embeddings=True,
    rope_scaling=_LLAMA32_SCALING,
)
_llama3(
    "llama3.2-3b",
    n_layer=28,
    n_head=24,
    n_kv_head=8,
    n_embd=3072,
    intermediate_size=8192,
    tie_embeddings=True,
    rope_scaling=_LLAMA32_SCALING,
)
_llama3(
    "llama3.1-8b",
    n_layer=32,
    n_head=32,
    n_kv_head=8,
    n_embd=4096,
    intermediate_size=14336,
    tie_embeddings=False,
    rope_scaling=_LLAMA31_SCALING,
)
# Tiny CPU model with GQA and the full Llama 3 RoPE scaling (~16M parameters, mostly the
# embedding). A short original context makes the scaling change frequencies at this size.
_llama3(
    "llama3-debug",
    block_size=256,
    n_layer=4,
    n_head=4,
    n_kv_head=2,
    n_embd=128,
    intermediate_size=384,
    tie_embeddings=True,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
)

# Hugging Face name pattern -> ours; `\1` is the layer index.
_HF_NAMES = {
    r"model\.embed_tokens\.": "tok_embeddings.",
    r"model\.layers\.(\d+)\.input_layernorm\.": r"layers.\1.attention_norm.",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.": r"layers.\1.attention.wq.",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.": r"layers.\1.attention.wk.",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.": r"layers.\1.attention.wv.",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.": r"layers.\1.attention.wo.",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.": r"layers.\1.ffn_norm.",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.": r"layers.\1.feed_forward.w1.",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.": r"layers.\1.feed_forward.w3.",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.": r"layers.\1.feed_forward.w2.",
    r"model\.norm\.": "norm.",
    r"lm_head\.": "output.",
}


def from_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: TransformerConfig
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face ``LlamaForCausalLM`` state dict to ours.

    Both use the rotate-half RoPE layout, so the query and key weights need no permutation.

    Args:
        state_dict: Hugging Face weights.
        config: Our matching architecture.

    Returns:
        A state dict for :class:`~plugintrain.model_zoo.transformer.Transformer`.

    Raises:
        ValueError: On a key this adapter does not know.
    """
    # Old checkpoints also store the RoPE frequencies, which we derive from the config.
    weights = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    out = {_rename(key): value for key, value in weights.items()}
    if config.tie_embeddings:  # tied checkpoints may omit lm_head
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _rename(hf_key: str) -> str:
    for pattern, ours in _HF_NAMES.items():
        key, n = re.subn(f"^{pattern}", ours, hf_key)
        if n:
            return key
    raise ValueError(f"Unexpected key {hf_key!r} in a Hugging Face Llama state dict.")


def tp_plan() -> dict[str, str]:
    """Tensor/sequence-parallel plan, as data: module path pattern -> style name.

    GPT-2's plan (the families share :class:`~plugintrain.model_zoo.transformer.Transformer`
    and its module names) plus SwiGLU's up projection ``w3``, column-wise like the gate.
    Query heads and key/value heads are sharded alike, so tp must divide ``n_kv_head``.
    """
    return {**gpt2.tp_plan(), "layers.*.feed_forward.w3": "colwise"}
