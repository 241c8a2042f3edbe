"""Qwen3 dense models (Qwen team 2025): presets, Hugging Face weight adapter, tensor-parallel plan.

Qwen3 is Llama's layout (RMSNorm, SwiGLU, GQA, rotate-half RoPE) with two changes our
shared :class:`~plugintrain.model_zoo.transformer.Transformer` builds from the config: a
head size set apart from the width (``head_size``; Qwen3-0.6B has 16 heads of 128 over
a width of 1024) and an RMSNorm over each head's queries and keys before RoPE
(``qk_norm``).
"""

from typing import Any

from plugintrain.model_zoo import llama3
from plugintrain.model_zoo.config import TransformerConfig, register_preset
from plugintrain.model_zoo.family_spec import FamilySpec, GGUFLayout
from plugintrain.model_zoo.layers import QK_NORM_PLAN
from plugintrain.model_zoo.weight_plans import Plan, renamed

PRESET_DEFAULTS = dict(
    family="qwen3",
    vocab_size=151936,
    block_size=40960,
    head_size=128,
    bias=False,
    norm="rmsnorm",
    norm_eps=1e-6,
    mlp="swiglu",
    position="rope",
    rope_theta=1_000_000.0,
    qk_norm=True,
)
"""What every Qwen3 preset shares (the Qwen3-MoE presets too, with their own family)."""


def _qwen3(name: str, **sizes: int | bool | str) -> None:
    register_preset(TransformerConfig(name=name, **(PRESET_DEFAULTS | sizes)))


# Sizes from the published config.json files (Qwen/Qwen3-0.6B, -1.7B, -8B).
_qwen3(
    "qwen3-0.6b",
    n_layer=28,
    n_head=16,
    n_kv_head=8,
    n_embd=1024,
    intermediate_size=3072,
    tie_embeddings=True,
)
_qwen3(
    "qwen3-1.7b",
    n_layer=28,
    n_head=16,
    n_kv_head=8,
    n_embd=2048,
    intermediate_size=6144,
    tie_embeddings=True,
)
_qwen3(
    "qwen3-8b",
    n_layer=36,
    n_head=32,
    n_kv_head=8,
    n_embd=4096,
    intermediate_size=12288,
    tie_embeddings=False,
)
# Tiny CPU model. Heads of 64 channels make the query width (4 x 64 = 256) twice n_embd,
# as in Qwen3-0.6B (2048 over 1024). No Qwen tokenizer is available offline, so it reads
# GPT-2's ids (data/shakespeare_gpt2).
_qwen3(
    "qwen3-debug",
    vocab_size=50257,
    block_size=256,
    n_layer=4,
    n_head=4,
    n_kv_head=2,
    n_embd=128,
    head_size=64,
    intermediate_size=384,
    tie_embeddings=True,
    tokenizer="gpt2",
)

_BLOCK = {
    **llama3.BLOCK_NAMES,
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
}
"""Our module -> Hugging Face ``Qwen3ForCausalLM``'s, inside block ``{i}``."""


def hf_names(config: TransformerConfig) -> dict[str, str]:
    """Our tensor name -> Hugging Face ``Qwen3ForCausalLM``'s: Llama's names plus each
    block's query and key norms. Both use the rotate-half RoPE layout, so no weight is
    permuted; a tied head maps to the embedding."""
    return llama3.hf_names(config, _BLOCK)


def hf_import_plan(config: TransformerConfig) -> Plan:
    """Our tensors from a Hugging Face ``Qwen3ForCausalLM``'s."""
    return renamed(hf_names(config))


def hf_export_plan(config: TransformerConfig) -> Plan:
    """Hugging Face ``Qwen3ForCausalLM`` tensors from ours (a tied head left out).

    Raises:
        ValueError: If ``config`` is not the layout ``Qwen3ForCausalLM`` builds.
    """
    _check_layout(config)
    names = hf_names(config)
    if config.tie_embeddings:
        del names["output.weight"]
    return renamed({theirs: ours for ours, theirs in names.items()})


def _check_layout(config: TransformerConfig) -> None:
    """Raise unless ``config`` has every feature ``Qwen3ForCausalLM`` fixes."""
    fixed = {"bias": False, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
             "rope_scaling": None, "qk_norm": True}  # fmt: skip
    bad = {
        key: getattr(config, key) for key, value in fixed.items() if getattr(config, key) != value
    }
    if bad:
        raise ValueError(
            f"{config.name}: a Hugging Face Qwen3 has {fixed}, but this model has {bad};"
            " build it from a qwen3 preset without overriding those fields."
        )


def from_hf_config(hf: dict[str, Any], name: str) -> TransformerConfig:
    """Our config for a Hugging Face ``Qwen3Config`` (as its ``config.json`` holds it).

    Raises:
        ValueError: For a variant our model does not build (attention biases, sliding-window
            layers, an activation other than SiLU, scaled RoPE such as YaRN).
    """
    _check_hf_variant(hf, name)
    heads = hf["num_attention_heads"]
    return TransformerConfig(
        name=name,
        family="qwen3",
        vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 32768),
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        n_embd=hf["hidden_size"],
        head_size=hf.get("head_dim") or 128,  # transformers' Qwen3Config default
        intermediate_size=hf["intermediate_size"],
        bias=False,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        position="rope",
        rope_theta=_hf_rope_theta(hf, name),
        qk_norm=True,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def _check_hf_variant(hf: dict[str, Any], name: str) -> None:
    act = hf.get("hidden_act", "silu")
    layers = set(hf.get("layer_types") or ["full_attention"])
    unsupported = {
        "attention_bias": hf.get("attention_bias", False),
        "use_sliding_window": hf.get("use_sliding_window", False),
        "hidden_act": act if act != "silu" else None,
        "layer_types": sorted(layers) if layers != {"full_attention"} else None,
    }
    bad = {key: value for key, value in unsupported.items() if value}
    if bad:
        raise ValueError(
            f"{name}: plugintrain's Qwen3 does not build {bad}; it builds the dense models'"
            " full attention without biases, with SiLU gates (attention_bias false,"
            " use_sliding_window false, hidden_act 'silu' in config.json)."
        )


def _hf_rope_theta(hf: dict[str, Any], name: str) -> float:
    """The RoPE base (:func:`~plugintrain.model_zoo.llama3.hf_rope`); only unscaled RoPE is
    built."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"{name}: RoPE type {kind!r} is not supported for Qwen3; plugintrain builds"
            " 'default' RoPE (drop rope_scaling to run within the pretraining context)."
        )
    return llama3.hf_rope(hf, name)[0]


def to_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen3ForCausalLM`` with ``config``'s shape."""
    _check_layout(config)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **llama3.hf_shape(config),
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layer,
    }


def tp_plan(config: TransformerConfig | None = None) -> dict[str, str]:
    """Tensor/sequence-parallel plan, as data: module path pattern -> style name.

    Llama's plan (see :func:`plugintrain.model_zoo.llama3.tp_plan`) plus the per-head query
    and key norms as ``head_norm`` (:data:`~plugintrain.model_zoo.layers.QK_NORM_PLAN`):
    after the column-parallel ``wq``/``wk`` each tp rank holds a contiguous subset of whole
    heads, so the ``(B, T, nh_local, hs)`` activations are sharded over the heads (dim 2).
    The norm acts on each head's ``hs`` channels, which are never split, so it runs on the
    local heads without communication. The replicated weight's gradient, which differs
    per rank, is left ``Partial`` over tp and summed where it is reduced (the gradient
    engine, FSDP2, or a redistribution to the weight's placement). This holds with or
    without sequence parallelism.
    """
    return {**llama3.tp_plan(), **QK_NORM_PLAN}


SPEC = FamilySpec(
    name="qwen3",
    hf_model_type="qwen3",
    tp_plan=tp_plan,
    hf_import_plan=hf_import_plan,
    hf_export_plan=hf_export_plan,
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
    gguf=GGUFLayout(
        architecture="qwen3",
        tensors=llama3.gguf_tensors(
            {
                **llama3.GGUF_BLOCK,
                "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm",
            }
        ),
        config=llama3.GGUF_CONFIG,
    ),
)
