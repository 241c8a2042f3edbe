"""The gpu tier: packed rows and the masked loss on CUDA's attention and loss kernels.

CUDA's SDPA takes another kernel for an explicit mask (memory-efficient attention) than
for ``is_causal`` (flash): packed rows must still give each example's own logits, and
the chunked masked cross-entropy torch's, in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.model_zoo.cross_entropy import IGNORE_INDEX, chunked_cross_entropy

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
LENGTHS = (37, 90, 1, 64)  # and 64 positions of padding: one row of 256
SEQ = 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["llama3-debug", "deepseek-v3-debug"])
def test_packed_rows_give_each_examples_own_logits(preset: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    config = dataclasses.replace(TransformerConfig.from_name(preset), block_size=SEQ)
    model = Transformer(config).to(CUDA).eval()
    examples = [torch.randint(config.vocab_size, (n,), device=CUDA) for n in LENGTHS]
    pad = SEQ - sum(LENGTHS)
    tokens = torch.cat([*examples, torch.zeros(pad, dtype=torch.long, device=CUDA)])[None]
    positions = torch.cat([torch.arange(n, device=CUDA) for n in [*LENGTHS, pad]])[None]
    with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
        packed = model(tokens, positions=positions)[0].float()
        start = 0
        for example in examples:
            alone = model(example[None])[0].float()
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(
                packed[start : start + len(example)], alone, rtol=tolerance, atol=tolerance
            )
            start += len(example)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_cross_entropy_equals_torch_on_cuda(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300, 50304, device=CUDA).to(dtype).requires_grad_()
    targets = torch.randint(50304, (4, 300), device=CUDA)
    targets[:, :120] = IGNORE_INDEX
    ours = chunked_cross_entropy(logits, targets, chunk_tokens=128)
    (grad,) = torch.autograd.grad(ours, logits)
    reference_logits = logits.detach().float().requires_grad_()
    reference = (
        F.cross_entropy(reference_logits.flatten(0, 1), targets.flatten(), reduction="sum")
        / targets.numel()
    )
    (reference_grad,) = torch.autograd.grad(reference, reference_logits)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(grad.float(), reference_grad, rtol=tolerance, atol=tolerance)
