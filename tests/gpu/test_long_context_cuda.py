"""The gpu tier: long context's attention kernels on CUDA (issue 46).

- Packed rows (:class:`~plugintrain.model_zoo.layers.Documents`) run only fused kernels
  on CUDA (SDPA restricted to flash and memory-efficient attention: the math kernel, which
  materializes the weights, is not allowed) and equal the CPU result within bf16
  tolerance, forward and backward.
- Context parallelism's lower-right causal attention (SDPA with ``causal_lower_right``,
  the memory-efficient kernel) equals the CPU path (two flash calls merged by their
  log-sum-exps), forward and backward, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from plugintrain.model_zoo.context_parallel import lower_right_attention
from plugintrain.model_zoo.layers import Documents

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _grads(fn, tensors, grad):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad.to(out.device, out.dtype))
    return [out.detach().float().cpu(), *(t.grad.float().cpu() for t in leaves)]


def _close(got, want, dtype):
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_take_fused_kernels_and_equal_the_cpu(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 512, 64, generator=generator) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query heads
    grad = torch.randn(2, 4, 512, 64, generator=generator)
    positions = torch.stack([torch.arange(512) % 200, torch.arange(512) % 77])  # documents

    def attend(q, k, v):
        return Documents.of(positions.to(q.device)).attend(q, k, v)

    want = _grads(attend, (q, k, v), grad)
    with sdpa_kernel(FUSED):  # the math kernel is not allowed: a fallback would raise
        got = _grads(attend, (t.to(CUDA, dtype) for t in (q, k, v)), grad)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_right_attention_on_cuda_equals_the_cpu(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 256, 64, generator=generator)
    k, v = (torch.randn(2, 2, 1024, 64, generator=generator) for _ in range(2))
    grad = torch.randn(2, 8, 256, 64, generator=generator)
    want = _grads(lower_right_attention, (q, k, v), grad)
    with sdpa_kernel(FUSED):
        got = _grads(lower_right_attention, (t.to(CUDA, dtype) for t in (q, k, v)), grad)
    _close(got, want, dtype)
