"""``plugintrain estimate`` with a quantized LoRA base (QLoRA): the packed bytes a rank holds,
the layouts ``--fit`` proposes, and the 70B recipe's layout.

References are independent of the estimate: the real model's
:class:`~plugintrain.model_zoo.quantization.QuantizedWeight` parameters (built on the meta
device by :func:`~plugintrain.model_zoo.lora.inject`), FSDP2's sharding rule written out
(``torch.chunk`` on dim 0, every shard padded to the first's size), and the NF4 / int8
layouts' arithmetic from the QLoRA paper and LLM.int8().
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from plugintrain.cli import main
from plugintrain.estimate import Layout, estimate, fitting_layouts
from plugintrain.estimate.parameters import layout_params, stage_params
from plugintrain.estimate.recipe import recipe_layout
from plugintrain.estimate.state import training_state
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.lora import LoRASpec, inject, quantized_weights
from plugintrain.model_zoo.transformer import Transformer

TARGETS = ("*.attention.*", "*.feed_forward.*")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "scale" / "llama3_70b_qlora_2gpu.yaml"


def _real_packed(config: TransformerConfig, kind: str) -> list[torch.Tensor]:
    """The packed parameters of the model the LoRA callback builds, on the meta device."""
    with torch.device("meta"):
        module = nn.Module()
        module.model = Transformer(config)
    inject(module, LoRASpec(r=8, target_modules=TARGETS, quantize=kind))
    return [weight.packed for _, weight in quantized_weights(module)]


def _quantized_held(config: TransformerConfig, layout: Layout) -> int:
    """The estimate's quantized (uint8) bytes on dp rank 0."""
    held = stage_params(layout_params(config, layout), config, layout, 0)
    packed = [p for p in held if p.dtype == torch.uint8]
    return training_state(packed, layout)[0][0]


def _layout(kind: str | None, **degrees: int) -> Layout:
    strategy = "hybrid" if degrees else "single"
    return Layout.of(
        strategy, lora_r=8, lora_targets=TARGETS, lora_quantize=kind, seq_len=64, **degrees
    )


def test_the_packed_layouts_add_up_as_the_papers_say() -> None:
    """A 128 x 128 weight: NF4 is 8192 code bytes, 256 block codes, one group scale and the
    offset (4 bytes each); int8 is 16384 codes and an fp32 scale a row."""
    nf4, int8 = (
        _real_packed(TransformerConfig.from_name("llama3-debug"), k) for k in ("nf4", "int8")
    )
    assert nf4[0].dtype == int8[0].dtype == torch.uint8
    assert nf4[0].numel() == 128 * 128 // 2 + 128 * 128 // 64 + 4 + 4
    assert int8[0].numel() == 128 * 128 + 4 * 128


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_one_process_holds_every_packed_byte(kind: str) -> None:
    config = TransformerConfig.from_name("llama3-debug")
    real = sum(p.numel() * p.element_size() for p in _real_packed(config, kind))
    assert _quantized_held(config, _layout(kind)) == real


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dp", [2, 3])
def test_fsdp2_shards_the_packed_bytes_with_its_padding(kind: str, dp: int) -> None:
    """Packed sizes are multiples of 4: over 3 ranks every shard is padded."""
    config = TransformerConfig.from_name("llama3-debug")
    # FSDP2 splits dim 0 with torch.chunk and pads each shard to the first one's size.
    packed = _real_packed(config, kind)
    shard = sum(torch.chunk(p, dp)[0].numel() for p in packed)
    if dp == 3:
        assert shard > sum(p.numel() for p in packed) / 3
    assert _quantized_held(config, _layout(kind, dp=dp, zero_stage=3)) == shard


def test_quantizing_the_base_lowers_the_parameters_by_the_packing() -> None:
    """One process: the unquantized estimate less the adapted fp32 weights plus their
    packed bytes is the quantized one (the adapters, norms and embeddings unchanged)."""
    config = TransformerConfig.from_name("llama3-debug")
    plain, quantized = (estimate(config, _layout(k)).peak for k in (None, "nf4"))
    weights = sum(math.prod(shape) for shape in _real_shapes(config))
    packed = sum(p.numel() for p in _real_packed(config, "nf4"))
    assert quantized.parameters == plain.parameters - 4 * weights + packed
    assert (quantized.gradients, quantized.optimizer) == (plain.gradients, plain.optimizer)


def _real_shapes(config: TransformerConfig) -> list[torch.Size]:
    with torch.device("meta"):
        model = Transformer(config)
    return [
        m.weight.shape
        for path, m in model.named_modules()
        if isinstance(m, nn.Linear) and (".attention." in path or ".feed_forward." in path)
    ]


def test_fit_proposes_nf4_where_the_base_fits_only_so(capsys) -> None:
    config = TransformerConfig.from_name("llama3-debug")
    base = _layout(None)
    totals = {k: estimate(config, _layout(k)).peak.total for k in (None, "int8", "nf4")}
    assert totals[None] > totals["int8"] > totals["nf4"]
    fits = fitting_layouts(config, 1, totals["nf4"], base)
    assert [f.layout.quantize for f in fits] == ["nf4"]
    assert [f.layout.quantize for f in fitting_layouts(config, 1, totals[None], base)] == [None]
    args = ["estimate", "llama3-debug", "--lora_r", "8", "--lora_targets", *TARGETS]
    fit = ["--seq_len", "64", "--precision", "32-true", "--gpus", "1", "--fit", str(totals["nf4"])]
    assert main([*args, *fit]) == 0
    out = capsys.readouterr().out
    assert "  nf4  " in out and "set quantize: nf4 in the LoRA callback's init_args" in out, out


def test_a_quantized_base_is_refused_where_the_callback_refuses_it() -> None:
    config = TransformerConfig.from_name("llama3-debug")
    with pytest.raises(ValueError, match="not split over tensor-parallel ranks; use tp 1"):
        _layout("nf4", tp=2).check(config)
    with pytest.raises(ValueError, match="give lora_r"):
        Layout.of("single", lora_quantize="nf4")


def test_the_70b_recipe_holds_its_stage_s_packed_weights() -> None:
    """The recipe's QLoRA layout read as ``fit`` reads it, and its per-rank quantized bytes
    from the published Llama 3.1 70B shapes: NF4 bytes of each weight of the 40 blocks of
    the first pipeline stage."""
    config, layout = recipe_layout(RECIPE)
    assert (config.name, layout.quantize, layout.stage, layout.dims.dp, layout.dims.pp) == (
        "llama3.1-70b",
        "nf4",
        0,
        1,
        2,
    )
    d, ffn, kv = 8192, 28672, 1024

    def nf4(rows: int, cols: int) -> int:
        n = rows * cols
        blocks = n // 64
        return n // 2 + -(-blocks // 4) * 4 + 4 * -(-blocks // 256) + 4

    block = [nf4(d, d), nf4(kv, d), nf4(kv, d), nf4(d, d), nf4(ffn, d), nf4(ffn, d), nf4(d, ffn)]
    assert _quantized_held(config, layout) == 40 * sum(block)
