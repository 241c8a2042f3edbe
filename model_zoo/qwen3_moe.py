"""Qwen3-MoE models (Qwen team 2025): presets and Hugging Face weight adapter.

Qwen3's attention (grouped-query, per-head query/key RMSNorm, ``head_size`` apart from the
width) with the shared mixture-of-experts layer (:mod:`~plugintrain.model_zoo.moe`) in
every block: softmax router scores, top-8 of 128 experts for Qwen3-30B-A3B, no shared
experts. Qwen trains it with a global-batch load-balancing loss; here the same layer's
balancing options apply (the sequence-wise loss, or the routing bias).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plugintrain.model_zoo import deepseek_v3, llama3, qwen3
from plugintrain.model_zoo.config import MoEConfig, TransformerConfig, register_preset
from plugintrain.model_zoo.family_spec import FamilySpec
from plugintrain.model_zoo.weight_plans import Plan, Rule


def _qwen3_moe(name: str, moe: MoEConfig, **sizes: Any) -> None:
    defaults = qwen3.PRESET_DEFAULTS | dict(family="qwen3_moe", tie_embeddings=False)
    register_preset(TransformerConfig(name=name, moe=moe, **(defaults | sizes)))


# Qwen/Qwen3-30B-A3B's config.json (30.5B total, 3.3B active).
_qwen3_moe(
    "qwen3-30b-a3b",
    MoEConfig(n_routed_experts=128, top_k=8, moe_intermediate_size=768, score_func="softmax",
              norm_topk_prob=True),
    n_layer=48,
    n_head=32,
    n_kv_head=4,
    n_embd=2048,
    intermediate_size=6144,
)  # fmt: skip
# Tiny CPU model on GPT-2's ids.
_qwen3_moe(
    "qwen3-moe-debug",
    MoEConfig(n_routed_experts=8, top_k=2, moe_intermediate_size=96, score_func="softmax",
              norm_topk_prob=True, bias_update_rate=0.001),
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
)  # fmt: skip


def hf_names(config: TransformerConfig) -> dict[str, str]:
    """Our tensor name -> Hugging Face ``Qwen3MoeForCausalLM``'s, for every tensor but the
    stacked routed experts: Qwen3's names, with each MoE block's router as ``mlp.gate``."""
    names = qwen3.hf_names(config)
    for i in range(config.n_layer):
        if config.moe.is_moe_layer(i):
            for w in ("w1", "w2", "w3"):
                del names[f"layers.{i}.feed_forward.{w}.weight"]
            names[f"layers.{i}.feed_forward.router.weight"] = f"model.layers.{i}.mlp.gate.weight"
    return names


def hf_import_plan(config: TransformerConfig) -> Plan:
    """Our tensors from a Hugging Face ``Qwen3MoeForCausalLM``'s (experts stacked; the
    routing bias, which Qwen3-MoE does not have, starts at zero)."""
    plan = deepseek_v3.stacked_import_plan(config, hf_names(config), "mlp")
    for i in range(config.n_layer):
        if config.moe.is_moe_layer(i):
            router = f"model.layers.{i}.mlp.gate.weight"
            plan[f"layers.{i}.feed_forward.router.expert_bias"] = Rule((router,), _zero_bias)
    return plan


def _zero_bias(router: torch.Tensor) -> torch.Tensor:
    """A routing bias of zeros, one per expert (a row of the router)."""
    return torch.zeros(router.size(0), dtype=torch.float32, device=router.device)


def hf_export_plan(config: TransformerConfig) -> Plan:
    """Hugging Face ``Qwen3MoeForCausalLM`` tensors from ours, one per expert.

    Qwen3-MoE routes without a bias, so each router is written only if its routing bias is
    zero; a bias trained by ``moe.bias_update_rate`` makes building that tensor raise (it
    would choose other experts than the model did).

    Raises:
        ValueError: If ``config`` is not a layout ``Qwen3MoeForCausalLM`` builds.
    """
    _check_layout(config)
    plan = deepseek_v3.stacked_export_plan(config, hf_names(config), "mlp")
    for i in range(config.n_layer):
        if config.moe.is_moe_layer(i):
            ours = f"layers.{i}.feed_forward.router"
            plan[f"model.layers.{i}.mlp.gate.weight"] = Rule(
                (f"{ours}.weight", f"{ours}.expert_bias"), _unbiased_router(ours)
            )
    return plan


def _unbiased_router(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The router ``name``'s weight, checked to route without a bias."""

    def build(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # Exporters plan shapes on the meta device first: there is no value to check yet.
        if bias.device.type != "meta" and bias.any():
            raise ValueError(
                f"{name}.expert_bias is nonzero (trained with moe.bias_update_rate > 0), but a"
                " Hugging Face Qwen3-MoE routes without a bias and would choose other experts;"
                " train with bias_update_rate: 0 (or aux_loss_coeff) to export as qwen3_moe."
            )
        return weight

    return build


def _check_layout(config: TransformerConfig) -> None:
    moe = config.moe
    if (
        moe is None
        or moe.score_func != "softmax"
        or moe.n_shared_experts
        or moe.n_group != 1
        or moe.routed_scaling_factor != 1.0
        or moe.capacity_factor is not None
        or config.attention != "gqa"
        or not config.qk_norm
    ):
        raise ValueError(
            f"{config.name}: a Hugging Face Qwen3-MoE has Qwen3 attention and dropless softmax"
            f" routing without shared experts, groups or scaling; this model has moe={moe}."
        )


def from_hf_config(hf: dict[str, Any], name: str) -> TransformerConfig:
    """Our config for a Hugging Face ``Qwen3MoeConfig`` (its ``config.json``).

    Raises:
        ValueError: For what our model does not build (sliding windows, attention
            biases, dense layers between sparse ones other than the first ones).
    """
    dense = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 or dense != list(range(len(dense))):
        raise ValueError(
            f"{name}: plugintrain's Qwen3-MoE keeps only the first layers dense; got"
            f" decoder_sparse_step={step}, mlp_only_layers={dense}."
        )
    base = qwen3.from_hf_config(hf, name)
    moe = MoEConfig(
        n_routed_experts=hf.get("num_experts") or hf["num_local_experts"],  # Hub / transformers 5
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        first_k_dense=len(dense),
        score_func="softmax",
        norm_topk_prob=hf.get("norm_topk_prob", False),
    )
    return TransformerConfig(**{**vars(base), "family": "qwen3_moe", "moe": moe})


def to_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen3MoeForCausalLM`` shaped like ``config``."""
    _check_layout(config)
    moe = config.moe
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **llama3.hf_shape(config),
        "num_experts": moe.n_routed_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_k_dense)),
        "router_aux_loss_coef": 0.0,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layer,
    }


def tp_plan(config: TransformerConfig) -> dict[str, str]:
    """Qwen3's plan for the attention, embeddings and norms, and the feed-forward entries of
    :func:`plugintrain.model_zoo.deepseek_v3.feed_forward_plan` for ``config``'s blocks."""
    attention = {k: v for k, v in qwen3.tp_plan().items() if "feed_forward" not in k}
    return attention | deepseek_v3.feed_forward_plan(config)


SPEC = FamilySpec(
    name="qwen3_moe",
    hf_model_type="qwen3_moe",
    tp_plan=tp_plan,
    hf_import_plan=hf_import_plan,
    hf_export_plan=hf_export_plan,
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
)
