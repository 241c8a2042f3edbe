"""QLoRA's quantized base (``model_zoo/quantization.py``, the quantize path of
``model_zoo/lora.py``) against independent references.

- bitsandbytes (its CPU build) quantizes every attention and MLP projection of the real
  SmolLM2-135M: its NF4 codes, block absmax, group scales and offset equal ours; its 8-bit
  codes of the block absmax differ from ours only where its CPU kernel's binary search
  returns a code that is not the nearest on the dynamic map (ours is strictly nearer each
  time, and equals its pure-PyTorch kernel everywhere); the same state dequantizes to the
  same bits; int8 equals its vector-wise quantization to the bit.
- Plain PyTorch LoRA over the fake-quantized weight gives a quantized layer's forward and
  gradients, and a whole quantized model's logits.
- Loading and random init quantize each weight as quantizing it whole does, and loading
  holds the quantized model and one full-precision tensor at its peak, measured by a mode
  that sees every tensor.
- Bad input is refused in one line.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from plugintrain.callbacks.lora import quantized_base_problem
from plugintrain.core.memory import LiveTensorMemory, storage_bytes
from plugintrain.formats import load_into, open_weights
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.lora import LoRASpec, adapted_layers, init_adapters, inject
from plugintrain.model_zoo.quantization import (
    NF4_LEVELS,
    QUANTIZATIONS,
    QuantizedWeight,
    _block_absmax,
    dequantize,
    dynamic_map,
    fake_quantize,
    quantize,
)
from plugintrain.model_zoo.transformer import Transformer
from plugintrain.strategies import HybridParallelStrategy

from _hf_models import random_hf_llama

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
TARGETS = tuple(f"*.{name}" for name in PROJECTIONS)
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
"""QLoRA's bits per weight: a 4-bit code, an 8-bit block code per 64, an fp32 scale per
256 blocks (the paper's 4.127)."""

# ---- bitsandbytes on the real SmolLM2-135M -----------------------------------------------


@pytest.fixture(scope="module")
def bnb() -> Any:
    """bitsandbytes' functional API (its CPU build: the 'kernels-community' warning it
    prints on import is about a GPU kernel hub and harmless here)."""
    return pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2-135M's weights (the asset fetched and checked once, then read offline)."""
    return open_weights("smollm2-135m")


def _projections(weights: Any) -> list[str]:
    """Every attention and MLP projection's weight: 7 in each of the 30 layers."""
    names = [n for n in weights.names() if n.split(".")[-2] in PROJECTIONS]
    assert len(names) == 7 * weights.config.n_layer
    return names


@dataclasses.dataclass
class _NF4Pair:
    """One weight quantized by us and by bitsandbytes (the weight itself is not kept)."""

    name: str
    shape: tuple[int, ...]
    ours: Tensor  # our packed bytes
    absmax: Tensor  # our fp32 block absmax, before the double quantization
    codes: Tensor  # bitsandbytes' packed NF4 codes
    state: Any  # its QuantState (nested: the block absmax double-quantized)
    bnb_absmax: Tensor  # its fp32 block absmax, before the double quantization

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@pytest.fixture(scope="module")
def nf4_pairs(bnb: Any, smollm2: Any) -> list[_NF4Pair]:
    """Every projection of SmolLM2-135M (106M weights, 210 tensors) quantized both ways,
    read one tensor at a time."""
    pairs = []
    for name in _projections(smollm2):
        weight = smollm2.read(name)
        codes, state = bnb.quantize_4bit(
            weight, blocksize=64, quant_type="nf4", compress_statistics=True
        )
        # The block absmax before compress_statistics codes it: quantize_4bit's own kernel.
        _, bnb_absmax = torch.ops.bitsandbytes.quantize_4bit.default(weight, 64, "nf4", torch.uint8)
        absmax = _block_absmax(weight.reshape(-1))
        ours = quantize(weight, "nf4")
        pairs.append(_NF4Pair(name, tuple(weight.shape), ours, absmax, codes, state, bnb_absmax))
    return pairs


def _nf4_parts(packed: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed layout as the module documents it: the codes (two a byte, ``n / 2``
    bytes), a code per block of 64 (padded to 4 bytes), an fp32 scale per group of 256
    blocks, the fp32 offset."""
    blocks = n // 64
    groups = -(-blocks // 256)
    at = n // 2 + -(-blocks // 4) * 4
    assert packed.numel() == at + 4 * groups + 4
    codes, block_codes = packed[: n // 2], packed[n // 2 : n // 2 + blocks]
    return (
        codes,
        block_codes,
        packed[at : at + 4 * groups].view(torch.float32),
        packed[-4:].view(torch.float32),
    )


def _packed_from_state(codes: Tensor, state: Any) -> Tensor:
    """bitsandbytes' quantized weight in our layout, every byte its own."""
    pad = torch.zeros(-state.absmax.numel() % 4, dtype=torch.uint8)
    parts = (codes.view(-1), state.absmax, pad, state.state2.absmax, state.offset.view(1))
    return torch.cat([part.view(torch.uint8) for part in parts])


def _scaled_absmax(pair: _NF4Pair) -> Tensor:
    """The value each block's 8-bit code stands for: ``(absmax - offset) / group scale``,
    in fp32 as both quantizers compute it."""
    groups = torch.arange(pair.bnb_absmax.numel()) // 256
    inverse = 1.0 / pair.state.state2.absmax
    return ((pair.bnb_absmax - pair.state.offset) * inverse[groups]).clamp(-1, 1)


def test_nf4_levels_and_dynamic_map_are_bitsandbytes(bnb: Any) -> None:
    assert torch.equal(torch.tensor(NF4_LEVELS), bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), bnb.create_dynamic_map(signed=True))


def test_nf4_codes_block_absmax_scales_and_offset_equal_bitsandbytes(
    nf4_pairs: list[_NF4Pair],
) -> None:
    for pair in nf4_pairs:
        codes, _, group_scales, offset = _nf4_parts(pair.ours, pair.numel)
        assert torch.equal(codes, pair.codes.view(-1)), pair.name
        assert torch.equal(pair.absmax, pair.bnb_absmax), pair.name
        assert torch.equal(group_scales, pair.state.state2.absmax), pair.name
        assert torch.equal(offset, pair.state.offset.view(1)), pair.name


def test_nf4_block_codes_differ_only_where_ours_is_the_nearest(
    nf4_pairs: list[_NF4Pair],
) -> None:
    """bitsandbytes' CPU kernel (``cquantize_blockwise_cpu_fp32``, a binary search on the
    dynamic map) sometimes returns a neighbour of the nearest code; its pure-PyTorch kernel
    (the ``default`` one, registered as CompositeExplicitAutograd and reached here by
    redispatching past the CPU key) takes the nearest, as ours does: ours equals that one
    everywhere, and where it differs from the CPU kernel's, ours is strictly nearer."""
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    quantize_blockwise = torch.ops.bitsandbytes.quantize_blockwise.default
    dyn = dynamic_map().double()
    differing = blocks = 0
    for pair in nf4_pairs:
        _, ours, _, _ = _nf4_parts(pair.ours, pair.numel)
        centred = pair.bnb_absmax - pair.state.offset
        nearest, _ = quantize_blockwise.redispatch(default, centred, pair.state.state2.code, 256)
        assert torch.equal(ours, nearest), pair.name
        differ = ours != pair.state.absmax
        value = _scaled_absmax(pair).double()[differ]
        ours_off = (dyn[ours[differ].long()] - value).abs()
        theirs_off = (dyn[pair.state.absmax[differ].long()] - value).abs()
        assert bool((ours_off < theirs_off).all()), pair.name
        differing, blocks = differing + int(differ.sum()), blocks + differ.numel()
    assert 0 < differing < blocks / 100  # nonzero: the redispatch reached another kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_dequantized_from_one_state_equals_bitsandbytes_to_the_bit(
    bnb: Any, nf4_pairs: list[_NF4Pair], dtype: torch.dtype
) -> None:
    for pair in nf4_pairs:
        state = copy.copy(pair.state)
        state.dtype = dtype  # what dequantize_4bit returns
        expected = bnb.dequantize_4bit(pair.codes, state)
        ours = dequantize(_packed_from_state(pair.codes, pair.state), "nf4", pair.shape, dtype)
        assert ours.dtype == expected.dtype and torch.equal(ours, expected), pair.name


def test_nf4_dequantized_weights_differ_only_in_blocks_whose_code_differs(
    bnb: Any, nf4_pairs: list[_NF4Pair]
) -> None:
    changed = 0
    for pair in nf4_pairs:
        _, ours_codes, _, _ = _nf4_parts(pair.ours, pair.numel)
        ours = dequantize(pair.ours, "nf4", pair.shape, torch.float32)
        theirs = bnb.dequantize_4bit(pair.codes, pair.state)
        differ = (ours != theirs).view(-1, 64).any(dim=1)
        assert not bool((differ & (ours_codes == pair.state.absmax)).any()), pair.name
        changed += int(differ.sum())
    assert changed > 0  # the blocks with another code do dequantize otherwise


def test_nf4_bits_per_weight(nf4_pairs: list[_NF4Pair]) -> None:
    """4.127 bits a weight over the whole model, and per tensor what bitsandbytes holds
    (codes, block codes, group scales, offset) plus at most 3 bytes of alignment."""
    for pair in nf4_pairs:
        state = pair.state
        theirs = pair.codes.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel() + 4
        assert 0 <= pair.ours.numel() - theirs <= 3, pair.name
    bits = 8 * sum(pair.ours.numel() for pair in nf4_pairs)
    weights = sum(pair.numel for pair in nf4_pairs)
    assert bits / weights == pytest.approx(NF4_BITS, rel=0.01)


def test_int8_equals_bitsandbytes_vectorwise_to_the_bit(bnb: Any, smollm2: Any) -> None:
    """LLM.int8()'s vector-wise quantization without its outlier split (threshold 0): the
    codes, the fp32 row absmax and the dequantized weight (fp32, and that cast to bf16)."""
    for name in _projections(smollm2):
        weight = smollm2.read(name)
        rows, n = weight.shape[0], weight.numel()
        codes, row_absmax, _ = bnb.int8_vectorwise_quant(weight)
        ours = quantize(weight, "int8")
        at = -(-n // 4) * 4  # the layout: int8 codes padded to 4 bytes, an fp32 scale a row
        assert ours.numel() == at + 4 * rows
        assert torch.equal(ours[:n].view(torch.int8).view(weight.shape), codes), name
        assert torch.equal(ours[at:].view(torch.float32), row_absmax), name
        expected = bnb.int8_vectorwise_dequant(codes, row_absmax)
        assert torch.equal(dequantize(ours, "int8", weight.shape, torch.float32), expected), name
        bf16 = dequantize(ours, "int8", weight.shape, torch.bfloat16)
        assert torch.equal(bf16, expected.bfloat16()), name


# ---- the quantized layer and model against plain LoRA over the fake-quantized weight -------


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(128, 96)  # 12,288 weights: whole NF4 blocks

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


def _randomize_adapters(*modules: nn.Module) -> None:
    """The same random ``A`` and ``B`` in each of ``modules`` (B nonzero: the adapter
    contributes)."""
    for module in modules:
        init_adapters(module, seed=3)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, layer in adapted_layers(module):
                layer.lora_B.copy_(0.1 * torch.randn(layer.lora_B.shape, generator=gen))


def _quantized_and_reference(
    build: Any, kind: str, targets: tuple[str, ...]
) -> tuple[nn.Module, nn.Module]:
    """The same module twice: adapters over the base quantized as ``kind``, and plain
    adapters over base weights replaced by ``fake_quantize`` of them."""
    torch.manual_seed(0)
    quantized = build()
    reference = copy.deepcopy(quantized)
    spec = LoRASpec(r=4, alpha=8.0, target_modules=targets)
    inject(reference, spec)
    with torch.no_grad():
        for _, layer in adapted_layers(reference):
            layer.weight.copy_(fake_quantize(layer.weight, kind))
    inject(quantized, dataclasses.replace(spec, quantize=kind))
    _randomize_adapters(quantized, reference)
    return quantized, reference


def _forward_backward(module: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
    """The output, and the gradients of the input and of each adapter."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(grad)
    layer = module.proj
    return y.detach(), x.grad, layer.lora_A.grad, layer.lora_B.grad


@pytest.mark.parametrize("kind", QUANTIZATIONS)
def test_quantized_layer_is_plain_lora_over_the_fake_quantized_weight(kind: str) -> None:
    quantized, reference = _quantized_and_reference(_Projection, kind, ("proj",))
    assert isinstance(quantized.proj.weight, QuantizedWeight)
    gen = torch.Generator().manual_seed(7)
    x, grad = torch.randn(2, 5, 128, generator=gen), torch.randn(2, 5, 96, generator=gen)
    got = _forward_backward(quantized, x, grad)
    want = _forward_backward(reference, x, grad)
    for ours, expected in zip(got, want, strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    packed = quantized.proj.weight.packed
    assert packed.grad is None and not packed.requires_grad
    trains = {name for name, p in quantized.named_parameters() if p.requires_grad}
    assert trains == {"proj.lora_A", "proj.lora_B"}


@pytest.mark.parametrize("kind", QUANTIZATIONS)
def test_quantized_layer_under_bf16_autocast_is_plain_lora_under_it(kind: str) -> None:
    """Under autocast the base's matmul runs in bf16 on the weight dequantized to bf16, as
    autocast runs the reference's on its fake-quantized fp32 weight cast to bf16; the bias
    is added apart (one more bf16 rounding), so the two agree within bf16's resolution."""
    quantized, reference = _quantized_and_reference(_Projection, kind, ("proj",))
    gen = torch.Generator().manual_seed(7)
    x, grad = torch.randn(2, 5, 128, generator=gen), torch.randn(2, 5, 96, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _forward_backward(quantized, x, grad)
        want = _forward_backward(reference, x, grad)
    for ours, expected in zip(got, want, strict=True):
        scale = float(expected.abs().max())
        torch.testing.assert_close(ours, expected, rtol=2**-7, atol=2**-7 * scale)


def _debug_transformer() -> Transformer:
    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), vocab_size=256, block_size=32
    )
    return Transformer(config)


def test_quantized_model_logits_are_the_fake_quantized_plain_models() -> None:
    quantized, reference = _quantized_and_reference(_debug_transformer, "nf4", TARGETS)
    assert sum(1 for _ in adapted_layers(quantized)) == 7 * quantized.config.n_layer
    assert all(isinstance(layer.weight, QuantizedWeight) for _, layer in adapted_layers(quantized))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(quantized(tokens), reference(tokens), rtol=0, atol=0)


# ---- quantizing while loading, and at random init -----------------------------------------


def _quantized_on_meta(config: TransformerConfig, kind: str) -> Transformer:
    """A transformer built on the meta device, adapters injected with a ``kind`` base,
    allocated: what a QLoRA run loads its base into."""
    with torch.device("meta"):
        model = Transformer(config)
    inject(model, LoRASpec(r=4, target_modules=TARGETS, quantize=kind))
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def _quantized_weights(model: nn.Module) -> Iterator[tuple[str, QuantizedWeight]]:
    for path, layer in adapted_layers(model):
        assert isinstance(layer.weight, QuantizedWeight), path
        yield f"{path}.weight", layer.weight


@pytest.mark.parametrize("kind", QUANTIZATIONS)
def test_loading_quantizes_each_weight_as_quantizing_it_whole(tmp_path: Path, kind: str) -> None:
    weights = open_weights(random_hf_llama(tmp_path / "hf", vocab=256))
    model = _quantized_on_meta(weights.config, kind)
    load_into(model, weights)
    quantized = dict(_quantized_weights(model))
    assert len(quantized) == 7 * weights.config.n_layer
    for name, weight in quantized.items():
        assert torch.equal(weight.packed, quantize(weights.read(name), kind)), name
    for name, param in model.state_dict().items():
        if name.rpartition(".")[0] not in quantized and "lora_" not in name:
            assert torch.equal(param, weights.read(name)), name


@pytest.mark.parametrize("kind", QUANTIZATIONS)
def test_random_init_is_the_plain_init_quantized(kind: str) -> None:
    """A quantized model's ``init_weights`` draws each base weight whole under its own name
    and quantizes it: the plain model's weight (same seed) quantized; the rest is equal."""
    config = dataclasses.replace(TransformerConfig.from_name("llama3-debug"), vocab_size=256)
    torch.manual_seed(0)
    plain = Transformer(config).state_dict()
    torch.manual_seed(0)
    model = _quantized_on_meta(config, kind)
    model.init_weights()
    quantized = dict(_quantized_weights(model))
    for name, weight in quantized.items():
        assert torch.equal(weight.packed, quantize(plain[name], kind)), name
    for name, param in model.state_dict().items():
        if name.rpartition(".")[0] not in quantized and "lora_" not in name:
            assert torch.equal(param, plain[name]), name


def test_loading_holds_the_quantized_model_and_one_full_tensor_at_its_peak(
    tmp_path: Path,
) -> None:
    """Peak bytes while loading, measured by a mode that sees every tensor the reads,
    copies and quantization make: at most the quantized model plus the largest single
    tensor in full precision, plus 10%. The model is chosen so that the full-precision
    projections (2 layers, 31 MB) are more than the largest tensor (the tied embedding,
    17 MB) plus that margin: holding them whole would exceed the bound."""
    path = random_hf_llama(tmp_path / "hf", vocab=8192, tied=True, hidden=512, intermediate=2048)
    weights = open_weights(path)
    model = _quantized_on_meta(weights.config, "nf4")
    held = list(model.parameters()) + list(model.buffers())
    shapes = [weights.reader.shape(name) for name in weights.reader.names()]
    largest = max(torch.Size(shape).numel() for shape in shapes) * 4  # fp32 in the file
    projections = sum(w.numel() for _, w in _quantized_weights(model)) * 4
    assert projections > 1.1 * largest + 0.1 * storage_bytes(held)  # the bound tells
    with LiveTensorMemory() as memory:
        memory.track(held)
        load_into(model, weights)
    assert memory.peak_bytes <= 1.1 * (storage_bytes(held) + largest)


# ---- bad input ------------------------------------------------------------------------


def test_unknown_quantization_is_one_line_naming_it_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"quantize='nf5'.*nf4, int8$") as error:
        LoRASpec(quantize="nf5")
    assert "\n" not in str(error.value)


def test_quantize_with_base_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantize='nf4' and base_dtype='bf16'.*drop base_dtype"):
        LoRASpec(quantize="nf4", base_dtype="bf16")


def test_a_target_not_in_whole_blocks_is_kept_with_one_warning() -> None:
    module = nn.ModuleDict({"proj": nn.Linear(128, 96), "odd": nn.Linear(10, 7)})  # 70 weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject(module, LoRASpec(r=2, target_modules=("proj", "odd"), quantize="nf4"))
    messages = [str(w.message) for w in caught if "quantize" in str(w.message)]
    assert len(messages) == 1 and "odd" in messages[0] and "proj" not in messages[0]
    assert isinstance(module["proj"].weight, QuantizedWeight)
    assert isinstance(module["odd"].weight, nn.Parameter)


def test_tensor_parallel_is_refused_naming_what_works() -> None:
    problem = quantized_base_problem(HybridParallelStrategy(tensor_parallel=2), "nf4")
    assert problem is not None and "\n" not in problem
    assert "tensor_parallel=2" in problem
    for works in ("ddp_bucketed", "zero1", "zero2", "pipeline", "tensor_parallel: 1"):
        assert works in problem
    assert quantized_base_problem(HybridParallelStrategy(tensor_parallel=1), "nf4") is None


def test_merging_into_a_quantized_base_is_one_line() -> None:
    module = _Projection()
    inject(module, LoRASpec(r=2, target_modules=("proj",), quantize="nf4"))
    with pytest.raises(ValueError, match="cannot merge a LoRA adapter into a nf4 base") as error:
        module.proj.merge()
    assert "\n" not in str(error.value)


def test_the_python_api_is_refused_too_before_the_model_is_built() -> None:
    """A Trainer built in Python (no CLI check): the callback's ``setup`` raises the same
    line, before ``configure_model`` allocates or loads anything."""
    from types import SimpleNamespace

    from plugintrain.callbacks import LoRA

    trainer = SimpleNamespace(strategy=HybridParallelStrategy(tensor_parallel=2))
    with pytest.raises(ValueError, match="not split over tensor-parallel ranks") as error:
        LoRA(quantize="int8").setup(trainer, nn.Module(), "fit")  # type: ignore[arg-type]
    assert "\n" not in str(error.value)


def test_a_compiled_block_computes_what_the_eager_one_does() -> None:
    """torch.compile (AOTAutograd, as inductor runs it) of a block holding quantized
    layers: the same output and gradients as eager (the quantized matmul runs eagerly)."""
    torch.manual_seed(0)
    config = TransformerConfig.from_name("llama3-debug")
    eager = Transformer(config)
    spec = LoRASpec(r=4, target_modules=("*.attention.*", "*.feed_forward.*"), quantize="nf4")
    inject(eager, spec)
    init_adapters(eager, seed=1)
    compiled = copy.deepcopy(eager)
    for block in compiled.layers.values():
        block.compile(backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
    outputs = []
    for model in (eager, compiled):
        logits = model(tokens)
        logits.square().mean().backward()
        outputs.append((logits, [p.grad for p in model.parameters() if p.requires_grad]))
    (a, grads_a), (b, grads_b) = outputs
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def test_a_zero_row_codes_as_zeros_in_int8() -> None:
    weight = torch.randn(4, 64)
    weight[2] = 0
    values = dequantize(quantize(weight, "int8"), "int8", (4, 64), torch.float32)
    assert torch.equal(values[2], torch.zeros(64)) and not values.isnan().any()
