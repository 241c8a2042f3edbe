"""LoRA on one process: the layer's math, merging, initialization, injection and its errors,
``base_dtype``, and the callback through a one-process Lightning fit."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.callbacks import LoRA
from plugintrain.model_zoo import CausalLM, TransformerConfig, lora
from plugintrain.model_zoo.lora import LoRALinear, LoRASpec
from plugintrain.precision_plugins import FP32Precision

VOCAB = 64
SEQ = 16
TARGETS = ("*.attention.wq", "*.attention.wo", "*.feed_forward.w1", "*.feed_forward.w2")
EPS = torch.finfo(torch.float32).eps


def _lm(preset: str = "llama3-debug") -> CausalLM:
    """A 2-layer debug CausalLM with its transformer built (paths ``model.layers.*``)."""
    torch.manual_seed(0)
    config = dataclasses.replace(
        TransformerConfig.from_name(preset), n_layer=2, vocab_size=VOCAB, block_size=SEQ
    )
    module = CausalLM(config)
    module.configure_model()
    return module


def _adapted(preset: str = "llama3-debug", **spec: Any) -> CausalLM:
    """``_lm`` with adapters on TARGETS, A initialized and B random (so they do something)."""
    module = _lm(preset)
    lora.inject(module, LoRASpec(r=4, alpha=8.0, target_modules=TARGETS, **spec))
    lora.init_adapters(module, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, layer in lora.adapted_layers(module):
            layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=gen))
    return module


def _tokens() -> Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _weights(module: nn.Module) -> dict[str, Tensor]:
    return {path: layer.weight.detach().clone() for path, layer in lora.adapted_layers(module)}


@torch.no_grad()
def test_merged_forward_equals_unmerged() -> None:
    """Merged logits against the unmerged two-path forward (base + adapter) of the same model."""
    module = _adapted()
    tokens = _tokens()
    unmerged = module(tokens)
    assert lora.merge(module) == 8  # 4 targets x 2 layers
    merged = module(tokens)
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    lora.unmerge(module)
    for _, layer in lora.adapted_layers(module):
        layer.lora_B.zero_()
    base = module(tokens)
    assert (merged - base).abs().max() > 100 * 1e-5, "the adapters must change the logits"


@torch.no_grad()
def test_merge_twice_is_merge_once() -> None:
    """Weights after two merges against the weights after one (bitwise)."""
    module = _adapted()
    lora.merge(module)
    once = _weights(module)
    lora.merge(module)
    assert all(layer.merged for _, layer in lora.adapted_layers(module))
    for path, weight in _weights(module).items():
        assert torch.equal(weight, once[path]), path


@torch.no_grad()
def test_unmerge_restores_the_base() -> None:
    """Unmerged weights against the weights before merging: bitwise with B == 0, else within
    the rounding of one add and one subtract, ``2 * eps(float32) * max|W'|`` per layer."""
    module = _adapted()
    before = _weights(module)
    lora.merge(module)
    merged = _weights(module)
    assert lora.unmerge(module) == 8
    assert not any(layer.merged for _, layer in lora.adapted_layers(module))
    for path, weight in _weights(module).items():
        assert not torch.equal(merged[path], before[path]), path
        bound = 2 * EPS * merged[path].abs().max().item()
        assert (weight - before[path]).abs().max().item() <= bound, path
    lora.unmerge(module)  # a no-op now
    assert all(torch.equal(w, _weights(module)[p]) for p, w in _weights(module).items())

    lora.init_adapters(module, seed=3)  # B == 0
    before = _weights(module)
    lora.merge(module)
    lora.unmerge(module)
    for path, weight in _weights(module).items():
        assert torch.equal(weight, before[path]), path


@torch.no_grad()
def test_init_kaiming_bound_zero_b_and_seeded() -> None:
    """A against PyTorch's Linear Kaiming bound 1/sqrt(in), B against zeros, and a second
    init with the same seed (bitwise) and another seed (different)."""
    module = _adapted()  # B random before init_adapters below
    lora.init_adapters(module, seed=11)
    first = {p: layer.lora_A.clone() for p, layer in lora.adapted_layers(module)}
    for path, layer in lora.adapted_layers(module):
        bound = 1 / math.sqrt(layer.in_features)
        assert torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B)), path
        assert layer.lora_A.abs().max() <= bound, path
        assert layer.lora_A.abs().max() > 0.9 * bound, "uniform over the whole range"
        assert not layer.merged
    lora.init_adapters(module, seed=11)
    for path, layer in lora.adapted_layers(module):
        assert torch.equal(layer.lora_A, first[path]), path
    lora.init_adapters(module, seed=12)
    for path, layer in lora.adapted_layers(module):
        assert not torch.equal(layer.lora_A, first[path]), path


@torch.no_grad()
def test_init_gaussian_std() -> None:
    """Gaussian A against PEFT's ``init_lora_weights="gaussian"`` (std 1/r); B zeros."""
    module = _adapted(init="gaussian")
    lora.init_adapters(module, seed=11, init="gaussian")
    values = torch.cat([layer.lora_A.flatten() for _, layer in lora.adapted_layers(module)])
    assert values.std().item() == pytest.approx(1 / 4, rel=0.05)
    assert all(not layer.lora_B.any() for _, layer in lora.adapted_layers(module))


def test_lora_linear_forward_matches_plain_torch() -> None:
    """LoRALinear's output against ``x W^T + b + (alpha/r) x A^T B^T`` in float64 torch."""
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    layer = LoRALinear(base, r=4, alpha=6.0, dropout=0.0, dtype=None)
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.scaling == 1.5
    with torch.no_grad():
        layer.lora_A.normal_()
        layer.lora_B.normal_()
    x = torch.randn(3, 5, 24)
    w, b, a, bb = (
        t.detach().double() for t in (base.weight, base.bias, layer.lora_A, layer.lora_B)
    )
    xd = x.double()
    expected = xd @ w.T + b + 1.5 * (xd @ a.T) @ bb.T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("r", [0, -1])
def test_bad_rank_raises(r: int) -> None:
    """LoRASpec against the rule that the rank is a positive integer."""
    with pytest.raises(ValueError, match=rf"r={r}"):
        LoRASpec(r=r)


def test_target_matching_nothing_lists_module_paths() -> None:
    """The error against the model's folded module paths."""
    with pytest.raises(ValueError, match="matches no module") as error:
        lora.inject(_lm(), LoRASpec(target_modules=("*.attention.nope",)))
    assert "'*.attention.nope'" in str(error.value)
    assert "model.layers.*.attention.wq" in str(error.value)


def test_target_matching_only_non_linear_modules_raises() -> None:
    """The error against the module it matched (an RMSNorm) and a Linear example."""
    with pytest.raises(ValueError, match="matches no Linear layer") as error:
        lora.inject(_lm(), LoRASpec(target_modules=("*.attention_norm",)))
    message = str(error.value)
    assert "model.layers.0.attention_norm (RMSNorm)" in message
    assert "model.layers.*.attention.wq" in message


def test_tied_head_target_raises() -> None:
    """gpt2-debug's head shares the embedding's weight: the error against both paths."""
    module = _lm("gpt2-debug")
    assert module.model.output.weight is module.model.tok_embeddings.weight
    with pytest.raises(ValueError, match="tied") as error:
        lora.inject(module, LoRASpec(target_modules=("model.output",)))
    assert "LoRA target model.output shares" in str(error.value)
    assert "model.tok_embeddings.weight" in str(error.value)


def test_trainable_matching_nothing_raises() -> None:
    """The ``trainable`` error against the model's folded module paths."""
    with pytest.raises(ValueError, match=re.escape("trainable pattern 'model.head'")) as error:
        lora.inject(_lm(), LoRASpec(target_modules=TARGETS, trainable=("model.head",)))
    assert "model.output" in str(error.value)
    assert "model.layers.*.feed_forward.w2" in str(error.value)


def test_trainable_module_trains_whole() -> None:
    """requires_grad against adapters plus the named module's parameters."""
    module = _lm()
    lora.inject(module, LoRASpec(target_modules=TARGETS, trainable=("model.norm",)))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    adapters = {n for n, _ in module.named_parameters() if lora.is_adapter_name(n)}
    assert trainable == adapters | {"model.norm.weight"}


@pytest.mark.parametrize("mode", ["none", "all", "lora_only"])
def test_bias_modes(mode: str) -> None:
    """requires_grad against the bias names each mode selects on gpt2-debug (which has biases)."""
    module = _lm("gpt2-debug")
    targets = ("*.attention.wq", "*.feed_forward.w1")
    adapted = lora.inject(module, LoRASpec(target_modules=targets, bias=mode))
    names = [n for n, _ in module.named_parameters()]
    adapters = {n for n in names if lora.is_adapter_name(n)}
    biases = {n for n in names if n.endswith(".bias")}
    expected = {
        "none": set(),
        "all": biases,
        "lora_only": {f"{path}.bias" for path in adapted},
    }[mode]
    assert len(adapters) == 2 * len(adapted) == 8
    assert expected <= biases
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == adapters | expected


@torch.no_grad()
def test_base_dtype_bf16() -> None:
    """Dtypes against the spec (adapted bases bf16, adapters and other layers fp32), and the
    logits against the fp32-base model's within bf16 rounding."""
    reference = _adapted()
    module = _adapted(base_dtype="bf16")
    for path, layer in lora.adapted_layers(module):
        assert layer.weight.dtype == torch.bfloat16, path
        assert not layer.weight.requires_grad
        assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32, path
        assert layer.lora_A.requires_grad and layer.lora_B.requires_grad
    assert module.model.layers["0"].attention.wk.weight.dtype == torch.float32
    assert module.model.tok_embeddings.weight.dtype == torch.float32
    tokens = _tokens()
    logits = module(tokens)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference(tokens), rtol=0.05, atol=0.02)


def test_base_dtype_keeps_what_trains_in_fp32() -> None:
    """With ``bias: lora_only`` on gpt2-debug, the adapted layers' biases train: they stay
    fp32 (no bf16 parameter trains without a master copy) while their weights go bf16."""
    module = _lm("gpt2-debug")
    spec = LoRASpec(target_modules=("*.attention.wq",), bias="lora_only", base_dtype="bf16")
    lora.inject(module, spec)
    for path, layer in lora.adapted_layers(module):
        assert layer.weight.dtype == torch.bfloat16 and not layer.weight.requires_grad, path
        assert layer.bias.dtype == torch.float32 and layer.bias.requires_grad, path


class _Snapshot(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def test_callback_fit_changes_only_adapters(tmp_path: Any) -> None:
    """Every parameter after a 1-process Lightning fit against its value at train start:
    adapters moved, everything else bitwise equal."""
    L.seed_everything(0, verbose=False)
    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=2, vocab_size=VOCAB, block_size=SEQ
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    module = CausalLM(config, optimizer, warmup_steps=0, min_lr_ratio=1.0)
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    snapshot = _Snapshot()
    callback = LoRA(r=4, alpha=8.0, target_modules=list(TARGETS))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[FP32Precision()], callbacks=[callback, snapshot],
    )  # fmt: skip
    trainer.fit(module, data)
    assert len(callback.adapted) == 8
    adapters = {n for n, _ in module.named_parameters() if lora.is_adapter_name(n)}
    assert len(adapters) == 16
    for name, param in module.named_parameters():
        initial = snapshot.initial[name]
        if name in adapters:
            assert param.requires_grad, name
            assert not torch.equal(param, initial), name
        else:
            assert not param.requires_grad, name
            assert torch.equal(param, initial), name
    optimizer_params = {p for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert {n for n, p in module.named_parameters() if p in optimizer_params} == adapters


def test_flops_per_token_change_matches_torch_flop_counter() -> None:
    """What MFU counts for a LoRA step: the config's 6N-based training FLOPs plus the
    callback's adjustment, against torch's FlopCounterMode over forward + backward of the
    full model and the adapted one (autograd skips frozen weights' gradients). Within 3%:
    the first layer's input gradient is skipped too, as nothing before it trains."""
    from torch.utils.flop_counter import FlopCounterMode

    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=4, vocab_size=512, block_size=64
    )
    counted = {}
    for adapted in (False, True):
        torch.manual_seed(0)
        module = CausalLM(config)
        module.configure_model()
        if adapted:
            spec = LoRASpec(
                r=8, target_modules=("*.attention.wq", "*.attention.wv", "*.feed_forward.*")
            )
            lora.inject(module, spec)
            lora.init_adapters(module, 0)
        x = torch.randint(0, 512, (2, 64))
        with FlopCounterMode(display=False) as counter:
            module.loss_fn(module(x), x).backward()
        counted[adapted] = counter.get_total_flops() / x.numel()
    change = lora.flops_per_token_change(module)
    assert change < 0  # frozen weights' gradients outweigh the adapters
    assert counted[False] + change == pytest.approx(counted[True], rel=0.03)
