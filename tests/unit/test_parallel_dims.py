"""ParallelDims and the tensor-parallel plans: validation without any process."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from torch import nn

from plugintrain.core.contracts import ParallelModule, StagedModel, check_contract
from plugintrain.model_zoo import (
    CausalLM,
    MNISTClassifier,
    Transformer,
    TransformerConfig,
    gpt2,
    llama3,
)
from plugintrain.strategies import HybridParallelStrategy, ParallelDims
from plugintrain.strategies.tensor_parallel import expand_plan, style


@pytest.mark.parametrize(
    ("world_size", "tp", "pp", "dp"), [(8, 2, 1, 4), (8, 2, 2, 2), (4, 4, 1, 1), (1, 1, 1, 1)]
)
def test_data_parallel_is_derived(world_size: int, tp: int, pp: int, dp: int) -> None:
    dims = ParallelDims(world_size, tensor_parallel=tp, pipeline_parallel=pp)
    assert dims.data_parallel == dp == dims.dp
    assert dims.tp_enabled == (tp > 1) and dims.dp_enabled == (dp > 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tensor_parallel": 4}, r"world_size=6 is not divisible .* = 4"),
        ({"world_size": 8, "tensor_parallel": 2, "data_parallel": 2}, r"= 4 != world_size=8"),
        ({"world_size": 4, "sequence_parallel": True}, r"sequence_parallel=True needs"),
        ({"world_size": 4, "virtual_pipeline_parallel": 2}, r"needs pipeline_parallel > 1"),
        ({"world_size": 4, "zero_stage": 4}, r"zero_stage must be one of .* got 4"),
        ({"world_size": 4, "expert_parallel": 3}, r"expert_parallel=3 must divide"),
        ({"world_size": 4, "tensor_parallel": 0}, r"'tensor_parallel': 0"),
    ],
)
def test_invalid_layouts_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "tp", "seq_len", "message"),
    [
        ({"n_head": 2, "n_kv_head": 2}, 4, None, r"'n_head': 2"),
        ({"n_head": 4, "n_kv_head": 2}, 4, None, r"'n_kv_head': 2"),
        ({"intermediate_size": 90}, 4, None, r"'ffn_dim \(MLP width\)': 90"),
        ({"vocab_size": 50257}, 2, None, r"'vocab_size': 50257"),
        ({}, 4, 30, r"'seq_len': 30"),
    ],
)
def test_model_not_divisible_by_tp(
    overrides: dict, tp: int, seq_len: int | None, message: str
) -> None:
    config = TransformerConfig.from_name("llama3-debug", **({"n_kv_head": 4} | overrides))
    dims = ParallelDims(4, tensor_parallel=tp, sequence_parallel=True)
    with pytest.raises(ValueError, match=message):
        dims.validate_model(config, seq_len)


def test_sequence_length_is_checked_only_with_sp() -> None:
    config = TransformerConfig.from_name("llama3-debug", n_kv_head=4)
    ParallelDims(4, tensor_parallel=4).validate_model(config, seq_len=30)


def test_strategy_rejects_unsupported_degrees_at_construction() -> None:
    with pytest.raises(ValueError, match=r"zero_stage=3 \(FSDP2\) cannot be combined with expert"):
        HybridParallelStrategy(expert_parallel=2, zero_stage=3)
    with pytest.raises(ValueError, match=r"zero_stage=3 \(FSDP2\) cannot be combined"):
        HybridParallelStrategy(pipeline_parallel=2, zero_stage=3)
    with pytest.raises(ValueError, match=r"microbatches to be a multiple of pipeline_parallel=2"):
        HybridParallelStrategy(pipeline_parallel=2, virtual_pipeline_parallel=2, microbatches=3)
    with pytest.raises(ValueError, match="sequence_parallel=True needs"):
        HybridParallelStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"wire_dtype='fp32' is not a torch dtype"):
        HybridParallelStrategy(pipeline_parallel=2, wire_dtype="fp32")


def test_pipeline_defaults() -> None:
    options = HybridParallelStrategy(pipeline_parallel=4).pipeline_options
    assert (options.schedule, options.microbatches) == ("1f1b", 4)
    interleaved = HybridParallelStrategy(pipeline_parallel=2, virtual_pipeline_parallel=2)
    assert interleaved.pipeline_options.schedule == "interleaved"
    wire = HybridParallelStrategy(wire_dtype="bfloat16").pipeline_options.wire_dtype
    assert wire == torch.bfloat16
    assert options.wire_dtype is None  # the training compute dtype, known at setup


@pytest.mark.parametrize("family", [gpt2, llama3])
def test_plans_cover_every_linear_and_resolve(family: object) -> None:
    preset = "gpt2-debug" if family is gpt2 else "llama3-debug"
    model = Transformer(TransformerConfig.from_name(preset, n_layer=2, vocab_size=64))
    plan = family.tp_plan()
    resolved = expand_plan(model, plan, sequence_parallel=True)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears <= set(resolved)
    for name in set(plan.values()):
        style(name, sequence_parallel=True)  # every style name maps to a ParallelStyle
    without_sp = expand_plan(model, plan, sequence_parallel=False)
    assert "norm" not in without_sp and "layers.0.attention" in without_sp


def test_unknown_style_and_unmatched_pattern_raise() -> None:
    model = Transformer(TransformerConfig.from_name("gpt2-debug", n_layer=1, vocab_size=64))
    with pytest.raises(ValueError, match="Unknown tensor-parallel style 'diagonal'"):
        style("diagonal", sequence_parallel=False)
    with pytest.raises(ValueError, match=r"'layers\.\*\.nope' matches no module"):
        expand_plan(model, {"layers.*.nope": "colwise"}, sequence_parallel=False)


def test_causal_lm_plan_is_keyed_under_its_model() -> None:
    plan = CausalLM("llama3-debug").tp_plan()
    assert plan["model.layers.*.attention.wq"] == "colwise"
    assert plan["model.output"] == "vocab_head"


def _strategy_on(devices: int, **kwargs: object) -> HybridParallelStrategy:
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=HybridParallelStrategy(**kwargs), logger=False
    )
    return trainer.strategy


def test_model_parallel_layouts_name_what_a_module_lacks() -> None:
    expected = (
        r"HybridParallelStrategy\(tensor_parallel=2, pipeline_parallel=1\) needs MNISTClassifier"
        r" to implement plugintrain.core.contracts.ParallelModule; it lacks config, model, tp_plan,"
        r" loss_fn, record_loss\."
    )
    with pytest.raises(TypeError, match=expected):
        _strategy_on(2, tensor_parallel=2).check_model(MNISTClassifier())
    # Data parallelism alone takes any module; CausalLM implements the whole contract.
    _strategy_on(2).check_model(MNISTClassifier())
    _strategy_on(2, tensor_parallel=2).check_model(CausalLM("llama3-debug"))
    assert isinstance(CausalLM("gpt2-debug"), ParallelModule)


def test_pipeline_needs_a_staged_model() -> None:
    with pytest.raises(TypeError, match=r"Linear to implement .*StagedModel; it lacks layers,"):
        check_contract(nn.Linear(2, 2), StagedModel, "pipeline_parallel=2")
    model = Transformer(TransformerConfig.from_name("gpt2-debug", n_layer=1, vocab_size=64))
    assert isinstance(model, StagedModel)


# ---- expert parallelism: refused before launch, naming the value and a fix that works -----


def test_expert_parallel_must_divide_the_data_parallel_ranks() -> None:
    with pytest.raises(
        ValueError, match=r"expert_parallel=3 must divide data_parallel=4.*\[1, 2, 4\]"
    ):
        _strategy_on(4, expert_parallel=3)


def test_expert_parallel_must_divide_the_routed_experts() -> None:
    strategy = _strategy_on(6, expert_parallel=3)  # dp = 6: ep divides it, not the 8 experts
    message = r"n_routed_experts=8 not divisible by expert_parallel=3 .* among \[1, 2\]"
    with pytest.raises(ValueError, match=message):
        strategy.check_model(CausalLM("deepseek-v3-debug"))
    _strategy_on(4, expert_parallel=2).check_model(CausalLM("deepseek-v3-debug"))


def test_expert_parallel_needs_experts() -> None:
    message = r"llama3-debug: expert_parallel=2 splits .* has none; use expert_parallel=1"
    with pytest.raises(ValueError, match=message):
        _strategy_on(2, expert_parallel=2).check_model(CausalLM("llama3-debug"))
    dense = TransformerConfig.from_name(
        "deepseek-v3-debug", moe=dataclasses.replace(
            TransformerConfig.from_name("deepseek-v3-debug").moe, first_k_dense=4
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"has none"):
        ParallelDims(2, expert_parallel=2).validate_model(dense)
    with pytest.raises(TypeError, match=r"expert_parallel=2\) needs MNISTClassifier"):
        _strategy_on(2, expert_parallel=2).check_model(MNISTClassifier())


def test_sequence_parallel_takes_the_sequence_wise_balance_loss() -> None:
    # Each tp rank's loss is its shard's part of the sequence's (tests/distributed/
    # test_expert_parallel.py checks the sum against one process).
    config = TransformerConfig.from_name("deepseek-v3-debug", vocab_size=64)
    ParallelDims(4, tensor_parallel=2, sequence_parallel=True).validate_model(config)
