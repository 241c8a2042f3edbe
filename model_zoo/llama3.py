"""Llama 3 (Grattafiori et al. 2024): presets, Hugging Face weight adapter, tensor-parallel plan."""

import dataclasses
from typing import Any

from plugintrain.model_zoo import gpt2
from plugintrain.model_zoo.config import RopeScaling, TransformerConfig, register_preset
from plugintrain.model_zoo.family_spec import FamilySpec, GGUFLayout
from plugintrain.model_zoo.weight_plans import Plan, renamed

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
# The sizes of the published Llama 3.1 70B and 405B (Meta's params.json), for planning
# runs at the scales they take (`plugintrain estimate ... --dry_run`).
_llama3(
    "llama3.1-70b",
    n_layer=80,
    n_head=64,
    n_kv_head=8,
    n_embd=8192,
    intermediate_size=28672,
    tie_embeddings=False,
    rope_scaling=_LLAMA31_SCALING,
)
_llama3(
    "llama3.1-405b",
    n_layer=126,
    n_head=128,
    n_kv_head=8,
    n_embd=16384,
    intermediate_size=53248,
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

BLOCK_NAMES = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
"""Our module -> Hugging Face ``LlamaForCausalLM``'s, inside block ``{i}`` (Qwen3 adds its
query/key norms to these)."""


def hf_names(config: TransformerConfig, block: dict[str, str] = BLOCK_NAMES) -> dict[str, str]:
    """Our tensor name -> Hugging Face ``LlamaForCausalLM``'s. Both use the rotate-half
    RoPE layout, so no weight is permuted; a tied head maps to the embedding.

    Args:
        config: The architecture.
        block: Our module -> theirs inside each block (another family's superset of
            :data:`BLOCK_NAMES`).
    """
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight",
    }
    for i in range(config.n_layer):
        for ours, theirs in block.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    return names


def hf_import_plan(config: TransformerConfig) -> Plan:
    """Our tensors from a Hugging Face ``LlamaForCausalLM``'s."""
    return renamed(hf_names(config))


def hf_export_plan(config: TransformerConfig) -> Plan:
    """Hugging Face ``LlamaForCausalLM`` tensors from ours (a tied head left out).

    Raises:
        ValueError: If ``config`` has query/key norms, which a Llama does not hold.
    """
    if config.qk_norm:
        raise ValueError(
            f"{config.name}: a Hugging Face Llama has no query/key norms, but qk_norm=True;"
            " build the model as family 'qwen3' to export them."
        )
    names = hf_names(config)
    if config.tie_embeddings:
        del names["output.weight"]
    return renamed({theirs: ours for ours, theirs in names.items()})


def from_hf_config(hf: dict[str, Any], name: str) -> TransformerConfig:
    """Our config for a Hugging Face ``LlamaConfig`` (as its ``config.json`` holds it).

    A ``head_dim`` other than ``hidden_size / num_attention_heads`` becomes ``head_size``.

    Raises:
        ValueError: For a Llama variant our model does not build (biases, another
            activation, a RoPE type other than Llama 3's).
    """
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or width // heads
    unsupported = {
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "hidden_act": hf.get("hidden_act", "silu")
        if hf.get("hidden_act", "silu") != "silu"
        else None,
    }
    bad = {key: value for key, value in unsupported.items() if value}
    if bad:
        raise ValueError(f"{name}: plugintrain's Llama does not build {bad}.")
    theta, scaling = hf_rope(hf, name)
    return TransformerConfig(
        name=name,
        family="llama3",
        vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        n_embd=width,
        head_size=head_dim if head_dim * heads != width else None,
        intermediate_size=hf["intermediate_size"],
        bias=False,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def hf_rope(hf: dict[str, Any], name: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` and ``rope_scaling`` keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"{name}: RoPE type {kind!r} is not supported; plugintrain builds 'default' and"
            " 'llama3' RoPE."
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, RopeScaling(**{key: params[key] for key in fields})


def to_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` with ``config``'s shape."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **hf_shape(config)}


def hf_shape(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` keys Hugging Face's Llama-like models (Llama, Qwen3) share: sizes,
    norm, activation, no biases, tied head, RoPE."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        # transformers 5 reads `rope_parameters`; earlier versions and vLLM read the rest.
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "rope_scaling": None
        if config.rope_scaling is None
        else {k: v for k, v in rope.items() if k != "rope_theta"},
    }


def tp_plan(config: TransformerConfig | None = None) -> dict[str, str]:
    """Tensor/sequence-parallel plan, as data: module path pattern -> style name.

    GPT-2's plan (the families share :class:`~plugintrain.model_zoo.transformer.Transformer`
    and its module names) plus SwiGLU's up projection ``w3``, column-wise like the gate.
    Query heads and key/value heads are sharded alike, so tp must divide ``n_kv_head``.
    """
    return {**gpt2.tp_plan(), "layers.*.feed_forward.w3": "colwise"}


# Hugging Face module in a block -> llama.cpp's tensor kind (its Llama converter).
GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_CONFIG = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "vocab_size": "vocab_size",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    # llama.cpp takes n_embd / n_head per head unless told (Qwen3's heads are wider).
    "attention.key_length": "head_dim",
    "rope.dimension_count": "head_dim",
    "attention.value_length": "head_dim",
}
"""GGUF metadata key -> Hugging Face ``config.json`` key, for Llama-like models."""


def gguf_tensors(block: dict[str, str]) -> dict[str, str]:
    """A Llama-like model's Hugging Face tensor -> GGUF tensor, its blocks' by ``block``."""
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        **{
            f"model.layers.{{i}}.{module}.weight": f"blk.{{i}}.{kind}.weight"
            for module, kind in block.items()
        },
    }


SPEC = FamilySpec(
    name="llama3",
    hf_model_type="llama",
    tp_plan=tp_plan,
    hf_import_plan=hf_import_plan,
    hf_export_plan=hf_export_plan,
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
    gguf=GGUFLayout(
        architecture="llama",
        tensors=gguf_tensors(GGUF_BLOCK),
        config=GGUF_CONFIG,
        permuted_qk=True,
        rope_freqs=True,
    ),
)
