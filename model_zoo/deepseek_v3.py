"""DeepSeek-V3-style models (DeepSeek-AI 2024): presets, Hugging Face weight adapter,
tensor-parallel plan.

Multi-head latent attention (:mod:`~plugintrain.model_zoo.mla`) in every block, and a
mixture of experts (:mod:`~plugintrain.model_zoo.moe`) after the first
``moe.first_k_dense`` dense blocks: 256 routed experts of which a token picks 8 by
sigmoid scores, limited to 4 of 8 groups, plus one shared expert, balanced by a routing
bias instead of an auxiliary loss. The multi-token-prediction module of the paper is not
built (its 14B parameters are not in the 671B). The full preset uses plain RoPE over
DeepSeek-V3's 4K pretraining context (no YaRN extension).
"""

from __future__ import annotations

from typing import Any

from plugintrain.model_zoo import llama3
from plugintrain.model_zoo.config import MLAConfig, MoEConfig, TransformerConfig, register_preset
from plugintrain.model_zoo.family_spec import FamilySpec
from plugintrain.model_zoo.weight_plans import Plan, Rule, renamed, stacked

_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_a_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
"""Our MLA module -> Hugging Face ``DeepseekV3Attention``'s."""
_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Our SwiGLU projections -> Hugging Face's (dense MLPs, shared experts, each expert)."""


def _deepseek(name: str, mla: MLAConfig, moe: MoEConfig, **sizes: Any) -> None:
    defaults = dict(
        family="deepseek_v3",
        bias=False,
        norm="rmsnorm",
        norm_eps=1e-6,
        mlp="swiglu",
        position="rope",
        rope_theta=10000.0,
        tie_embeddings=False,
        attention="mla",
    )
    register_preset(TransformerConfig(name=name, mla=mla, moe=moe, **(defaults | sizes)))


# DeepSeek-V3 (671B total, 37B active), from its published config.json.
_deepseek(
    "deepseek-v3",
    MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128),
    MoEConfig(n_routed_experts=256, top_k=8, moe_intermediate_size=2048, n_shared_experts=1,
              first_k_dense=3, score_func="sigmoid", routed_scaling_factor=2.5, n_group=8,
              topk_group=4, bias_update_rate=0.001, aux_loss_coeff=0.0001),
    vocab_size=129280,
    block_size=4096,
    n_layer=61,
    n_head=128,
    n_embd=7168,
    intermediate_size=18432,
)  # fmt: skip
# About 1B parameters (0.3B active): trains on one GPU.
_deepseek(
    "moe-1b",
    MLAConfig(kv_lora_rank=256, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64),
    MoEConfig(n_routed_experts=32, top_k=4, moe_intermediate_size=512, n_shared_experts=1,
              first_k_dense=1, score_func="sigmoid", routed_scaling_factor=1.0, n_group=4,
              topk_group=2, bias_update_rate=0.001, aux_loss_coeff=0.0001),
    vocab_size=50257,
    block_size=1024,
    n_layer=16,
    n_head=16,
    n_embd=1024,
    intermediate_size=2816,
    tokenizer="gpt2",
)  # fmt: skip
# Tiny CPU model on GPT-2's ids (no DeepSeek tokenizer is available offline). Its bias
# moves 10x faster than DeepSeek-V3's: a debug run has hundreds of steps, not 100,000s.
_deepseek(
    "deepseek-v3-debug",
    MLAConfig(kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32),
    MoEConfig(n_routed_experts=8, top_k=2, moe_intermediate_size=96, n_shared_experts=1,
              first_k_dense=1, score_func="sigmoid", routed_scaling_factor=1.0, n_group=2,
              topk_group=2, bias_update_rate=0.01, aux_loss_coeff=0.0001),
    vocab_size=50257,
    block_size=256,
    n_layer=4,
    n_head=4,
    n_embd=128,
    intermediate_size=384,
    tokenizer="gpt2",
)  # fmt: skip


def hf_names(config: TransformerConfig) -> dict[str, str]:
    """Our tensor name -> Hugging Face ``DeepseekV3ForCausalLM``'s, for every tensor but the
    stacked routed experts (see :func:`hf_import_plan`)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight",
    }
    queries = ("wq",) if config.mla.q_lora_rank is None else ("wq_a", "q_a_norm", "wq_b")
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        names[f"{ours}.attention_norm.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.ffn_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for module in (*queries, "wkv_a", "kv_a_norm", "wkv_b", "wo"):
            names[f"{ours}.attention.{module}.weight"] = (
                f"{theirs}.self_attn.{_ATTENTION[module]}.weight"
            )
        names |= _ffn_names(config, i, f"{ours}.feed_forward", f"{theirs}.mlp")
    return names


def _ffn_names(config: TransformerConfig, index: int, ours: str, theirs: str) -> dict[str, str]:
    if not config.moe.is_moe_layer(index):
        return {f"{ours}.{w}.weight": f"{theirs}.{hf}.weight" for w, hf in _SWIGLU.items()}
    names = {
        f"{ours}.router.weight": f"{theirs}.gate.weight",
        f"{ours}.router.expert_bias": f"{theirs}.gate.e_score_correction_bias",
    }
    if config.moe.n_shared_experts:
        names |= {
            f"{ours}.shared_experts.{w}.weight": f"{theirs}.shared_experts.{hf}.weight"
            for w, hf in _SWIGLU.items()
        }
    return names


def expert_names(config: TransformerConfig, prefix: str = "mlp") -> dict[str, list[str]]:
    """Our stacked expert tensor -> the per-expert Hugging Face tensors it stacks, in
    expert order (the layout of DeepSeek's and Qwen's checkpoints on the Hub)."""
    names = {}
    for i in range(config.n_layer):
        if config.moe is None or not config.moe.is_moe_layer(i):
            continue
        for w, hf in _SWIGLU.items():
            names[f"layers.{i}.feed_forward.experts.{w}"] = [
                f"model.layers.{i}.{prefix}.experts.{e}.{hf}.weight"
                for e in range(config.moe.n_routed_experts)
            ]
    return names


def _expert(index: int) -> Any:
    return lambda stacked: stacked[index]


def stacked_import_plan(config: TransformerConfig, names: dict[str, str], prefix: str) -> Plan:
    """``names`` renamed, plus each stacked expert tensor built from its per-expert ones."""
    plan = renamed(names)
    for ours, theirs in expert_names(config, prefix).items():
        plan[ours] = stacked(theirs)
    return plan


def stacked_export_plan(config: TransformerConfig, names: dict[str, str], prefix: str) -> Plan:
    """The inverse of :func:`stacked_import_plan`, a tied head left out."""
    if config.tie_embeddings:
        names = {k: v for k, v in names.items() if k != "output.weight"}
    plan = renamed({theirs: ours for ours, theirs in names.items()})
    for ours, theirs in expert_names(config, prefix).items():
        for index, name in enumerate(theirs):
            plan[name] = Rule((ours,), _expert(index))
    return plan


def hf_import_plan(config: TransformerConfig) -> Plan:
    """Our tensors from a Hugging Face ``DeepseekV3ForCausalLM``'s (experts stacked)."""
    return stacked_import_plan(config, hf_names(config), "mlp")


def hf_export_plan(config: TransformerConfig) -> Plan:
    """Hugging Face ``DeepseekV3ForCausalLM`` tensors from ours, one per expert.

    Raises:
        ValueError: If ``config`` is not a layout ``DeepseekV3ForCausalLM`` builds.
    """
    _check_layout(config)
    return stacked_export_plan(config, hf_names(config), "mlp")


def _check_layout(config: TransformerConfig) -> None:
    moe = config.moe
    bad = {}
    if config.attention != "mla" or moe is None:
        bad["attention/moe"] = (config.attention, moe)
    elif moe.score_func != "sigmoid" or moe.n_shared_experts < 1 or moe.capacity_factor:
        bad["moe"] = moe
    if config.rope_scaling is not None or config.qk_norm:
        bad["rope_scaling/qk_norm"] = (config.rope_scaling, config.qk_norm)
    if bad:
        raise ValueError(
            f"{config.name}: a Hugging Face DeepSeek-V3 has MLA, sigmoid routing with shared"
            f" experts, dropless, and plain RoPE; this model has {bad}."
        )


def from_hf_config(hf: dict[str, Any], name: str) -> TransformerConfig:
    """Our config for a Hugging Face ``DeepseekV3Config`` (its ``config.json``).

    Raises:
        ValueError: For what our model does not build (attention biases, another
            activation, scaled RoPE such as YaRN).
    """
    act = hf.get("hidden_act", "silu")
    theta, scaling = llama3.hf_rope(hf, name)
    if hf.get("attention_bias") or act != "silu" or scaling is not None:
        raise ValueError(
            f"{name}: plugintrain's DeepSeek-V3 builds attention without biases, SiLU"
            " experts and unscaled RoPE (attention_bias false, hidden_act 'silu', no"
            " rope_scaling in config.json)."
        )
    mla = MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=hf.get("rope_interleave", True),
    )
    moe = MoEConfig(
        n_routed_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        first_k_dense=hf.get("first_k_dense_replace") or 0,
        score_func="sigmoid",
        norm_topk_prob=hf.get("norm_topk_prob", True),
        routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
    )
    return TransformerConfig(
        name=name,
        family="deepseek_v3",
        vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 4096),
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_embd=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        bias=False,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        position="rope",
        rope_theta=theta,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attention="mla",
        mla=mla,
        moe=moe,
    )


def to_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``DeepseekV3ForCausalLM`` shaped like ``config``."""
    _check_layout(config)
    mla, moe = config.mla, config.moe
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_dim,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "n_shared_experts": moe.n_shared_experts,
        "n_routed_experts": moe.n_routed_experts,
        "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "first_k_dense_replace": moe.first_k_dense,
        "norm_topk_prob": moe.norm_topk_prob,
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
    }


def tp_plan(config: TransformerConfig) -> dict[str, str]:
    """Tensor/sequence-parallel plan (module path pattern -> style name; see
    :func:`plugintrain.model_zoo.gpt2.tp_plan` for the styles), for ``config``'s blocks.

    Attention: the query and key/value up-projections (``wq`` or ``wq_b``, ``wkv_b``) are
    split by heads (column-wise), ``wo`` row-wise. The latent down-projections and their
    norms run replicated on plain tensors (whole sequences: ``gathered_tokens`` all-gathers
    them under SP), so each column-parallel input gets its own backward all-reduce, and the
    RoPE key that every head shares has its gradient summed over the head shards
    (``head_shared``). Feed-forward: :func:`feed_forward_plan`.
    """
    queries = "wq" if config.mla.q_lora_rank is None else "wq_b"
    return {
        "tok_embeddings": "vocab_embedding",
        "dropout": "sequence_scatter",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "gathered_tokens",
        f"layers.*.attention.{queries}": "colwise",
        "layers.*.attention.wkv_b": "colwise",
        "layers.*.attention.rope_key": "head_shared",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        **feed_forward_plan(config),
        "norm": "sequence_parallel",
        "output": "vocab_head",
    }


def feed_forward_plan(config: TransformerConfig) -> dict[str, str]:
    """The feed-forward entries of a mixture-of-experts model's plan, block by block: a
    dense block's SwiGLU is split as Llama's; a MoE block is not split by tp but runs on
    each rank's own tokens (``local_tokens`` with SP) and is laid out by the strategy
    (:mod:`plugintrain.strategies.expert_parallel`)."""
    plan = {}
    for i in range(config.n_layer):
        ffn = f"layers.{i}.feed_forward"
        if config.moe is not None and config.moe.is_moe_layer(i):
            plan[ffn] = "local_tokens"
        else:
            plan |= {ffn: "tp_input", f"{ffn}.w1": "colwise", f"{ffn}.w3": "colwise"}
            plan[f"{ffn}.w2"] = "rowwise"
    return plan


SPEC = FamilySpec(
    name="deepseek_v3",
    hf_model_type="deepseek_v3",
    tp_plan=tp_plan,
    hf_import_plan=hf_import_plan,
    hf_export_plan=hf_export_plan,
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
)
