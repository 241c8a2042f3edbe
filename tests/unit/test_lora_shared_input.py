"""LoRA adapters that share an input (issue 28): ``wq``/``wk``/``wv`` of an attention and
``w1``/``w3`` of a gated MLP draw one dropout mask and run one ``A`` matmul
(:class:`plugintrain.model_zoo.lora.SharedInput`). Checked against the unfused reference,
each adapter on its own (``shared = None``, the path ``test_lora.py`` checks against plain
torch): the same parameters give the same outputs and gradients without dropout, and with
dropout each adapter's output is ``x W^T + (alpha/r) (x * m) A^T B^T / (1 - p)`` with one
mask ``m`` for all of them."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from plugintrain.model_zoo import CausalLM, TransformerConfig, lora
from plugintrain.model_zoo.lora import LoRALinear, LoRASpec, SharedInput

VOCAB = 64
SEQ = 16
TARGETS = ("*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo")
TARGETS += ("*.feed_forward.*",)
# Float32 against float32 computed in another order (one matmul for three): a few ulps of
# the logits (|logits| < 4 here) and of the gradients.
ATOL = 1e-6


def _adapted(dropout: float = 0.0, preset: str = "llama3-debug", **spec: Any) -> CausalLM:
    """A 2-layer debug CausalLM with adapters on every projection, A initialized and B
    random (so they do something)."""
    torch.manual_seed(0)
    config = dataclasses.replace(
        TransformerConfig.from_name(preset), n_layer=2, vocab_size=VOCAB, block_size=SEQ
    )
    module = CausalLM(config)
    module.configure_model()
    lora.inject(module, LoRASpec(r=4, alpha=8.0, dropout=dropout, target_modules=TARGETS, **spec))
    lora.init_adapters(module, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, layer in lora.adapted_layers(module):
            layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=gen))
    return module


def _unfused(module: CausalLM) -> CausalLM:
    """A copy of ``module`` whose adapters each run on their own (the reference)."""
    reference = copy.deepcopy(module)
    for _, layer in lora.adapted_layers(reference):
        layer.shared = None
    return reference


def _forward_backward(module: CausalLM, tokens: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    logits = module(tokens)
    module.loss_fn(logits, tokens.roll(-1, dims=1)).backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _tokens() -> Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_inject_binds_the_layers_of_one_input_in_call_order() -> None:
    """wq, wk, wv of each attention share one SharedInput, in that order, and w1, w3 of
    each MLP another; wo and w2 (inputs of their own) none; names are unchanged."""
    module = _adapted()
    layers = dict(lora.adapted_layers(module))
    for block in ("model.layers.0", "model.layers.1"):
        attention = [layers[f"{block}.attention.{n}"] for n in ("wq", "wk", "wv")]
        mlp = [layers[f"{block}.feed_forward.{n}"] for n in ("w1", "w3")]
        for group in (attention, mlp):
            assert isinstance(group[0].shared, SharedInput)
            assert group[0].shared.layers == tuple(group)
            assert all(layer.shared is group[0].shared for layer in group)
        assert attention[0].shared is not mlp[0].shared
        assert layers[f"{block}.attention.wo"].shared is None
        assert layers[f"{block}.feed_forward.w2"].shared is None
    adapter_keys = {k for k in module.state_dict() if lora.is_adapter_name(k)}
    assert adapter_keys == {f"{p}.{n}" for p in layers for n in lora.ADAPTER_PARAMS}


def test_lone_layers_are_not_bound() -> None:
    """One adapted layer of a group (wq with wo; GPT-2's MLP has no w3) shares nothing."""
    module = _adapted(preset="gpt2-debug")
    lone = {p: layer.shared for p, layer in lora.adapted_layers(module) if "feed_forward" in p}
    assert lone and all(shared is None for shared in lone.values())
    torch.manual_seed(0)
    config = dataclasses.replace(TransformerConfig.from_name("llama3-debug"), n_layer=1)
    module = CausalLM(config)
    module.configure_model()
    lora.inject(module, LoRASpec(target_modules=("*.attention.wq", "*.attention.wo")))
    assert all(layer.shared is None for _, layer in lora.adapted_layers(module))


def test_shared_input_matches_unfused_without_dropout() -> None:
    """Logits and every adapter's gradient against the unfused reference, same parameters,
    dropout 0, in training mode."""
    module = _adapted(dropout=0.0)
    assert any(layer.shared is not None for _, layer in lora.adapted_layers(module))
    reference = _unfused(module)
    tokens = _tokens()
    logits, grads = _forward_backward(module, tokens)
    expected_logits, expected_grads = _forward_backward(reference, tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=ATOL)
    assert grads.keys() == expected_grads.keys() and len(grads) == 2 * 14
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=ATOL, msg=name)


@torch.no_grad()
def test_merged_model_matches_shared_forward() -> None:
    """Merging adapters bound to a SharedInput: the merged logits against the shared
    two-path forward (as test_lora checks for adapters on their own)."""
    module = _adapted()
    tokens = _tokens()
    unmerged = module(tokens)
    assert lora.merge(module) == 14
    torch.testing.assert_close(module(tokens), unmerged, rtol=1e-5, atol=1e-5)


def _group(p: float, r: int = 6) -> tuple[list[LoRALinear], SharedInput]:
    """q (A and B identities: its adapter's output is the dropped input itself), k and v
    with random adapters, over one 6-wide input, bound to one SharedInput."""
    torch.manual_seed(0)
    layers = [LoRALinear(nn.Linear(6, n), r=r, alpha=3.0, dropout=p, dtype=None) for n in (6, 4, 4)]
    with torch.no_grad():
        layers[0].lora_A.copy_(torch.eye(6))
        layers[0].lora_B.copy_(torch.eye(6))
        for layer in layers[1:]:
            layer.lora_A.normal_()
            layer.lora_B.normal_()
    shared = SharedInput(layers)
    for layer in layers:
        layer.shared = shared
    return layers, shared


def _reference(layer: LoRALinear, x: Tensor, mask: Tensor, p: float) -> Tensor:
    """``x W^T + b + (alpha/r) B A (x * mask) / (1 - p)`` in float64."""
    w, b, a, bb = (
        t.detach().double() for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B)
    )
    xd = x.double()
    return xd @ w.T + b + layer.scaling * ((xd * mask) @ a.T) @ bb.T / (1 - p)


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_one_dropout_mask_for_the_shared_input(p: float) -> None:
    """With dropout (fixed seed), q's adapter output reveals the mask (its A and B are
    identities); k's and v's outputs and every gradient equal the formula with that same
    mask; the mask drops about a fraction p; the same seed gives the same mask."""
    layers, _ = _group(p)
    x = torch.randn(40, 7, 6, requires_grad=True)
    torch.manual_seed(7)
    outputs = [layer(x) for layer in layers]  # in the module's order: q, k, v
    base = nn.functional.linear(x.detach(), layers[0].weight, layers[0].bias)
    kept = (outputs[0].detach() - base).abs() > 1e-6 * x.detach().abs()
    mask = kept.double()
    assert abs(1 - mask.mean().item() - p) < 4 * (p * (1 - p) / mask.numel()) ** 0.5
    for layer, out in zip(layers, outputs, strict=True):
        torch.testing.assert_close(out.double(), _reference(layer, x, mask, p), rtol=0, atol=1e-5)
    weights = [torch.randn(out.shape) for out in outputs]
    sum((out * w).sum() for out, w in zip(outputs, weights, strict=True)).backward()
    _check_gradients(layers, x, mask, p, weights)
    torch.manual_seed(7)
    again = layers[0](x.detach())
    assert torch.equal(again, outputs[0].detach())


def _check_gradients(
    layers: list[LoRALinear], x: Tensor, mask: Tensor, p: float, weights: list[Tensor]
) -> None:
    """Gradients of ``sum(out_i * weights_i)`` against float64 autograd of the formula."""
    xd = x.detach().double().requires_grad_(True)
    params = [
        (
            layer.lora_A.detach().double().requires_grad_(True),
            layer.lora_B.detach().double().requires_grad_(True),
        )
        for layer in layers
    ]
    total = xd.new_zeros(())
    for layer, (a, b), w in zip(layers, params, weights, strict=True):
        base = xd @ layer.weight.detach().double().T + layer.bias.detach().double()
        out = base + layer.scaling * ((xd * mask) @ a.T) @ b.T / (1 - p)
        total = total + (out * w.double()).sum()
    total.backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=0, atol=1e-4)
    for layer, (a, b) in zip(layers, params, strict=True):
        torch.testing.assert_close(layer.lora_A.grad.double(), a.grad, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer.lora_B.grad.double(), b.grad, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_a_layer_called_on_another_tensor_runs_its_own_adapter() -> None:
    """A module that calls k on another tensor than q (or v first) still gets each
    adapter's own math: against the layers unbound, dropout 0."""
    layers, shared = _group(0.0)
    x, other = torch.randn(3, 6), torch.randn(3, 6)
    expected = [_unbound(layer, t) for layer, t in zip(layers, (x, other, x), strict=True)]
    got = [layers[0](x), layers[1](other), layers[2](x)]
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    assert shared._input is None and not shared._pending, "the last layer lets go"
    torch.testing.assert_close(layers[2](x), expected[2], rtol=0, atol=ATOL)  # v first


def _unbound(layer: LoRALinear, x: Tensor) -> Tensor:
    shared, layer.shared = layer.shared, None
    try:
        return layer(x)
    finally:
        layer.shared = shared


@pytest.mark.parametrize("p", [0.01, 0.05, 0.3])
def test_dropout_zeroes_a_fraction_p_everywhere(p: float) -> None:
    """The CPU dropout (dropped entries drawn and zeroed by index below p = 0.1, a mask
    from one draw per entry from there) through an identity ``A`` on ones: zeros and
    ``1 / (1 - p)`` only, the zeros' fraction of each quarter of 2^18 entries within 5
    sigma of p, the input untouched, a new draw each call, the same one under the same
    seed."""
    x, eye = torch.ones(1024, 256), torch.eye(256)
    torch.manual_seed(3)
    out = lora._dropped_linear(x, eye, 1.0, p)
    assert torch.equal(x, torch.ones_like(x))
    assert ((out == 0) | (out == torch.tensor(1 / (1 - p)))).all()
    quarters = (out == 0).view(4, -1).double().mean(dim=1)
    sigma = (p * (1 - p) / quarters.new_tensor(out[:256].numel())).sqrt()
    assert ((quarters - p).abs() < 5 * sigma).all(), quarters
    assert not torch.equal(lora._dropped_linear(x, eye, 1.0, p), out)
    torch.manual_seed(3)
    assert torch.equal(lora._dropped_linear(x, eye, 1.0, p), out)


def test_drops_drawn_over_several_batches() -> None:
    """Geometric gaps drawn 3 at a time (many batches to reach n): sorted, distinct
    indices in [0, n), about n p of them."""
    n, p = 20_000, 0.05
    torch.manual_seed(0)
    drops = lora._drops(n, p, batch=3)
    assert drops.dtype == torch.int64
    assert drops.min() >= 0 and drops.max() < n
    assert (drops.diff() > 0).all()
    assert abs(len(drops) - n * p) < 5 * (n * p * (1 - p)) ** 0.5
