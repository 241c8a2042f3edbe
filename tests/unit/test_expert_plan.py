"""Tensor-parallel plans of the mixture-of-experts families, without any process.

Each plan splits every Linear of the attention and of the dense blocks and resolves on
the model; it leaves MLA's latent projections and every MoE layer's parameters to run
replicated (expert parallelism and the ``local_tokens`` style handle those: see
``tests/distributed/test_expert_parallel.py`` for the numbers).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plugintrain.model_zoo import Transformer, TransformerConfig, deepseek_v3, qwen3_moe
from plugintrain.strategies.expert_parallel import expert_layers
from plugintrain.strategies.tensor_parallel import SP_ONLY_STYLES, expand_plan, style

PLANS = {"deepseek_v3": deepseek_v3.tp_plan, "qwen3_moe": qwen3_moe.tp_plan}
# deepseek-v3-debug: low-rank queries, one dense block; moe-1b: direct queries (``wq``);
# qwen3-moe-debug: grouped-query attention, no dense block.
PRESETS = ["deepseek-v3-debug", "moe-1b", "qwen3-moe-debug"]


def _model(preset: str) -> tuple[TransformerConfig, nn.Module]:
    config = TransformerConfig.from_name(preset, n_layer=3, vocab_size=64)
    with torch.device("meta"):
        return config, Transformer(config)


@pytest.mark.parametrize("preset", PRESETS)
def test_plans_split_attention_and_dense_blocks_and_leave_experts_whole(preset: str) -> None:
    config, model = _model(preset)
    plan = PLANS[config.family](config)
    resolved = expand_plan(model, plan, sequence_parallel=True)
    moe_paths = [path for path, _ in expert_layers(model)]
    assert len(moe_paths) == 3 - config.moe.first_k_dense
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    latent = {n for n in linears if n.endswith((".wq_a", ".wkv_a"))}
    in_moe = {n for n in linears if n.startswith(tuple(f"{p}." for p in moe_paths))}
    assert linears - latent - in_moe <= set(resolved)
    assert not (latent | in_moe) & set(resolved)
    assert {resolved[p] for p in moe_paths} == {"local_tokens"}
    for name in set(plan.values()):
        style(name, sequence_parallel=True)
    without_sp = expand_plan(model, plan, sequence_parallel=False)
    assert not set(moe_paths) & set(without_sp)
    assert not SP_ONLY_STYLES & set(without_sp.values())


def test_mla_plan_sums_the_shared_rope_key_gradient() -> None:
    config, model = _model("deepseek-v3-debug")
    resolved = expand_plan(model, deepseek_v3.tp_plan(config), sequence_parallel=False)
    assert {p for p, s in resolved.items() if s == "head_shared"} == {
        f"layers.{i}.attention.rope_key" for i in range(3)
    }
    assert resolved["layers.0.attention.wq_b"] == resolved["layers.0.attention.wkv_b"] == "colwise"
