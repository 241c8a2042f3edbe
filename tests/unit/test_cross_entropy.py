"""chunked_cross_entropy against torch's cross-entropy on fp32-upcast logits (the reference):
the same loss and gradients, and, measured by LiveTensorMemory, no fp32 copy of the whole
logits at any moment of forward and backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.model_zoo.cross_entropy import chunked_cross_entropy

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
