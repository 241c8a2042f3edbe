"""chunked_cross_entropy against torch's cross-entropy on fp32-upcast logits (the reference):
the same loss and gradients, and, measured by LiveTensorMemory, no fp32 copy of the whole
logits at any moment of forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo import CausalLM, TransformerConfig, cross_entropy
from plugintrain.model_zoo.cross_entropy import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    head_cross_entropy,
)
from plugintrain.model_zoo.lora import LoRASpec, inject
from plugintrain.strategies import ParallelDims

B, T, V = 2, 48, 1000
CHUNK = 20  # tokens: 96 = 4 full chunks and one of 16, so a ragged last chunk is covered


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _chunked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return chunked_cross_entropy(logits, targets, chunk_tokens=CHUNK)


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(B, T, V, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=generator)
    return logits, targets


def _loss_and_grad(
    loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().clone().requires_grad_()
    loss = loss_fn(logits, targets)
    (loss * scale).backward()  # a loss scale or accumulation divisor reaches backward
    return loss.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1024.0])
def test_equals_cross_entropy_of_fp32_logits(dtype: torch.dtype, scale: float) -> None:
    logits, targets = _inputs(dtype)
    loss, grad = _loss_and_grad(_chunked, logits, targets, scale)
    ref_loss, ref_grad = _loss_and_grad(_reference, logits, targets, scale)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # Both compute in fp32 from the same values: the loss agrees to fp32 rounding.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    # The gradient is rounded once to the logits' dtype, as the reference's `.float()`
    # backward rounds it: fp32 tolerance for fp32, one bf16 rounding for bf16.
    torch.testing.assert_close(grad, ref_grad)


def test_without_gradient_only_the_loss() -> None:
    logits, targets = _inputs(torch.bfloat16)
    with torch.no_grad():
        loss = chunked_cross_entropy(logits, targets, chunk_tokens=CHUNK)
    torch.testing.assert_close(loss, _reference(logits, targets).detach(), rtol=1e-6, atol=0)


def test_a_second_backward_is_refused_not_wrong() -> None:
    logits, targets = _inputs(torch.float32)
    loss = chunked_cross_entropy(logits, targets, chunk_tokens=CHUNK)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _peak_bytes(loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak live bytes over forward and backward, counting the logits (alive throughout)."""
    with LiveTensorMemory() as memory:
        memory.track(logits)
        loss_fn(logits, targets).backward()
    return memory.peak_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_never_holds_the_fp32_logits(dtype: torch.dtype) -> None:
    """The logits are alive throughout and counted; an fp32 (B, T, V) tensor existing at any
    moment would add ``fp32_bytes`` on top of them. The chunked loss stays under that:
    besides the logits it holds their gradient (which the LM head receives in any case)
    and a few chunks. The reference holds fp32 copies of the whole logits."""
    logits, targets = _inputs(dtype)
    logits_bytes = logits.numel() * logits.element_size()
    fp32_bytes = B * T * V * 4
    chunked = _peak_bytes(_chunked, logits, targets)
    full = _peak_bytes(_reference, logits.detach().clone().requires_grad_(), targets)
    chunk_bytes = CHUNK * V * 4
    assert chunked <= 2 * logits_bytes + 4 * chunk_bytes  # logits, gradient, chunk temporaries
    if dtype == torch.bfloat16:
        assert chunked < logits_bytes + fp32_bytes  # so no fp32 (B, T, V) ever existed
    else:  # the logits and their gradient are the two fp32 tensors; no third one
        assert chunked < logits_bytes + fp32_bytes + fp32_bytes
    assert full >= logits_bytes + 2 * fp32_bytes  # the reference: two or more fp32 copies


def test_causal_lm_loss_is_the_chunked_loss() -> None:
    config = TransformerConfig.from_name("llama3-debug", vocab_size=V, block_size=T, n_layer=1)
    torch.manual_seed(0)
    lm = CausalLM(config)
    lm.configure_model()
    tokens = torch.randint(0, V, (B, T))
    loss = lm.loss_fn(lm(tokens), tokens)
    (grad,) = torch.autograd.grad(loss, lm.model.output.weight)
    ref = _reference(lm(tokens), tokens)
    (ref_grad,) = torch.autograd.grad(ref, lm.model.output.weight)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad)


def test_vocab_sharded_dtensor_logits_keep_torch_s_loss_parallel() -> None:
    """Under tensor parallelism ``vocab_parallel_loss`` hands ``loss_fn`` DTensor logits
    sharded over the vocabulary; they keep torch's cross-entropy (its ``loss_parallel``
    rule). One rank here; tests/distributed shards them over two."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from plugintrain.model_zoo.cross_entropy import token_cross_entropy
    from plugintrain.strategies import vocab_parallel_loss

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        logits, targets = _inputs(torch.float32)
        sharded = DTensor.from_local(logits.detach(), mesh, [Shard(-1)]).requires_grad_()
        loss = vocab_parallel_loss(token_cross_entropy)(sharded, targets)
        with loss_parallel():
            loss.backward()
        ref_loss, ref_grad = _loss_and_grad(_reference, logits, targets, 1.0)
        torch.testing.assert_close(loss.detach(), ref_loss)
        torch.testing.assert_close(sharded.grad.full_tensor(), ref_grad)
    finally:
        dist.destroy_process_group()


def test_head_fused_with_the_loss_equals_the_head_then_torch_s_loss() -> None:
    """``head_cross_entropy(h, W, t)`` against torch's cross-entropy of ``h @ W.T`` (fp64
    inputs; the loss's fp32 softmax is the tolerance): the loss and the gradients of the
    hidden states and of the weight, with masked targets and a ragged last chunk."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=generator)
    targets[0, :7] = IGNORE_INDEX
    loss = head_cross_entropy(hidden, weight, targets, chunk_tokens=CHUNK)
    logits = (hidden @ weight.T).flatten(0, 1)
    ref = F.cross_entropy(logits, targets.flatten(), reduction="sum") / targets.numel()
    got = torch.autograd.grad(3 * loss, (hidden, weight))
    want = torch.autograd.grad(3 * ref, (hidden, weight))
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=0, check_dtype=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_equals_the_logits_path(dtype: torch.dtype) -> None:
    """``fused_head_loss: true`` (the head fused with the loss) gives the loss and the
    gradients of every parameter that the logits path gives, in fp32 and under bf16
    autocast (the gradients in the parameters' dtype either way)."""
    config = TransformerConfig.from_name("llama3-debug", vocab_size=V, block_size=T, n_layer=1)
    torch.manual_seed(0)
    lm = CausalLM(config)
    lm.configure_model()
    tokens = torch.randint(0, V, (B, T))
    params = list(lm.parameters())
    results = {}
    for fused in (False, True):
        lm.fused_head_loss = fused
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            loss = lm.batch_loss((tokens, tokens))
        results[fused] = (loss.detach(), torch.autograd.grad(loss, params))
    exact = dtype == torch.float32
    torch.testing.assert_close(
        results[True][0], results[False][0], rtol=1e-6 if exact else 1e-2, atol=0
    )
    for g, w in zip(results[True][1], results[False][1], strict=True):
        assert g.dtype == w.dtype
        tolerance = dict(rtol=1e-5, atol=1e-7) if exact else dict(rtol=5e-2, atol=5e-3)
        torch.testing.assert_close(g, w, **tolerance)


def test_the_fused_head_never_holds_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """From final hidden states to their gradient (a frozen head, as under LoRA), measured
    by LiveTensorMemory: the head then the chunked loss holds the logits and their gradient
    at once; the fused head holds less than the logits alone (chunks of 20 tokens, as a
    real vocabulary's are a few hundred)."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", CHUNK * V)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, 64, generator=generator, requires_grad=True)
    weight = torch.randn(V, 64, generator=generator)
    targets = torch.randint(0, V, (B, T), generator=generator)

    def fused() -> None:
        torch.autograd.grad(head_cross_entropy(hidden, weight, targets), hidden)

    def logits_path() -> None:
        torch.autograd.grad(chunked_cross_entropy(hidden @ weight.T, targets), hidden)

    peaks = {}
    for name, fn in (("fused", fused), ("logits", logits_path)):
        with LiveTensorMemory() as memory:
            memory.track(hidden, weight, targets)
            before = memory.live_bytes
            fn()
        peaks[name] = memory.peak_bytes - before
    logits_bytes = B * T * V * 4
    assert peaks["logits"] >= 2 * logits_bytes
    assert peaks["fused"] < logits_bytes


@pytest.mark.parametrize(
    "degrees", [dict(tensor_parallel=2), dict(pipeline_parallel=2), dict(zero_stage=3)]
)
def test_fused_head_loss_is_refused_where_the_head_is_sharded(degrees: dict) -> None:
    dims = ParallelDims(world_size=2, **degrees)
    trainer = SimpleNamespace(strategy=SimpleNamespace(parallel_dims=dims))
    with pytest.raises(ValueError, match="fused_head_loss=True needs the LM head whole"):
        CausalLM("llama3-debug", fused_head_loss=True).check_launch(trainer, None)
    CausalLM("llama3-debug", fused_head_loss=False).check_launch(trainer, None)  # the hint


def test_fused_head_loss_refuses_an_adapted_head() -> None:
    config = TransformerConfig.from_name(
        "llama3-debug", vocab_size=V, block_size=T, n_layer=1, tie_embeddings=False
    )
    lm = CausalLM(config, fused_head_loss=True)
    lm.configure_model()
    inject(lm, LoRASpec(target_modules=("*.output",)))
    tokens = torch.randint(0, V, (B, T))
    with pytest.raises(ValueError, match="needs a plain Linear LM head without a bias"):
        lm.batch_loss((tokens, tokens))
    lm.fused_head_loss = False  # the hint
    lm.batch_loss((tokens, tokens)).backward()
