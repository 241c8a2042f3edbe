"""Context-parallel attention on real gloo ranks against one process (issue 46).

Processes start once per world size (2 and 4). Every rank draws the same whole rows of
queries, keys and values (fp64), takes its two chunks (:class:`~plugintrain.core.
context_shard.ContextShard`), and runs :class:`~plugintrain.model_zoo.context_parallel.
ContextAttention` on them, forward and backward; the reference is torch's SDPA on the whole
rows under the dense mask (causal, or causal within each document of packed rows), in the
same process. Each rank's output and the gradients of its own queries, keys and values
(the keys' and values' after the reduce-scatter that sums every rank's contributions) must
be the reference's chunks within 1e-10: grouped-query heads, MLA's narrower values, and
packed rows whose documents cross the chunk and rank boundaries.

**Memory.** On the Llama debug model (vocabulary cut to 8,192) at 2,048 tokens, fp32, the
live-tensor peak of a training forward and backward beyond what lived before (weights,
their gradients, the batch), measured by ``LiveTensorMemory`` on every rank: cp4's largest
rank holds at most 0.3x one process's, and the dry run's figure
(:func:`~plugintrain.estimate.dry_run.activation_peak`) is within 5% of each degree's
measurement. ``benchmarks/context_parallel.py`` measures the same at 16,384 tokens, where
the ratio is the same (0.27x).

Per-rank attention FLOPs, counted by torch's ``FlopCounterMode`` around the attention of
causal rows (with torch's SDPA formula registered for the CPU flash kernel), agree within
5% across the ranks (each holds a chunk from each end).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _activations import step_activation_peak
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from plugintrain.core.context_shard import ContextShard
from plugintrain.estimate import Layout
from plugintrain.estimate.dry_run import activation_peak
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.model_zoo.context_parallel import ContextAttention
from plugintrain.model_zoo.layers import document_mask

from _harness import run_distributed

CASES = {
    "gqa rows": dict(heads=4, kv_heads=2, hs=16, hs_v=16, documents=None),
    "mla values": dict(heads=4, kv_heads=4, hs=24, hs_v=16, documents=None),
    "packed rows": dict(heads=4, kv_heads=2, hs=16, hs_v=16, documents=[[5, 11, 13], [7, 19]]),
}
T = 48
MEMORY_SEQ = 2048
MEMORY_CONFIG = TransformerConfig.from_name("llama3-debug", vocab_size=8192, block_size=MEMORY_SEQ)


def _positions(documents: list[list[int]] | None) -> torch.Tensor | None:
    """``(B, T)`` positions restarting at each listed document start."""
    if documents is None:
        return None
    rows = []
    for starts in documents:
        bounds = [0, *starts, T]
        rows.append(torch.cat([torch.arange(e - s) for s, e in itertools.pairwise(bounds)]))
    return torch.stack(rows)


def _case(rank: int, world: int, case: dict[str, Any]) -> dict[str, float]:
    generator = torch.Generator().manual_seed(7)

    def draw(heads: int, hs: int) -> torch.Tensor:
        return torch.randn(2, heads, T, hs, generator=generator, dtype=torch.float64)

    q, k = draw(case["heads"], case["hs"]), draw(case["kv_heads"], case["hs"])
    v = draw(case["kv_heads"], case["hs_v"])
    grad = draw(case["heads"], case["hs_v"])
    positions = _positions(case["documents"])
    # The reference: the whole rows in this process.
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None if positions is None else document_mask(positions)
    want = F.scaled_dot_product_attention(
        *whole, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    want.backward(grad)
    shard = ContextShard(world, rank, dist.group.WORLD)
    local = [shard.take(t, 2).clone().requires_grad_() for t in (q, k, v)]
    out = ContextAttention(shard, positions).attend(*local)
    out.backward(shard.take(grad, 2))
    errors = {"out": (out - shard.take(want, 2)).abs().max().item()}
    for name, got, ref in zip("qkv", local, whole, strict=True):
        errors[f"d{name}"] = (got.grad - shard.take(ref.grad, 2)).abs().max().item()
    return errors


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:  # shapes
    """torch's own SDPA formula (``sdpa_flop_count``) for the CPU flash kernel, which
    ``FlopCounterMode`` has none for: ``4 B H Lq Lk hs`` (a causal call counted whole)."""
    return flop_counter.sdpa_flop_count(query, key, value)


def _flops(rank: int, world: int) -> int:
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if cpu_flash not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(cpu_flash)(_cpu_flash_flops)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 16, generator=generator) for _ in range(3))
    shard = ContextShard(world, rank, dist.group.WORLD)
    with FlopCounterMode(display=False) as counter:
        ContextAttention(shard).attend(*(shard.take(t, 2) for t in (q, k, v)))
    return counter.get_total_flops()


def _activation_peak(rank: int, world: int) -> int:
    """Live-tensor peak of one training forward and backward beyond what lived before."""
    torch.manual_seed(0)
    module = CausalLM(MEMORY_CONFIG)
    module.configure_model()
    if world > 1:
        module.split_sequences(ContextShard(world, rank, dist.group.WORLD))
    x, y = torch.randint(0, 8000, (2, 1, MEMORY_SEQ), generator=torch.Generator().manual_seed(1))
    return step_activation_peak(module, x, y)


def _all(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {name: _case(rank, world, case) for name, case in CASES.items()}
    results["flops"] = _flops(rank, world)
    results["activation_peak"] = _activation_peak(rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_distributed(_all, request.param)


@pytest.mark.parametrize("case", CASES)
def test_attention_equals_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(ranks):
        for name, error in result[case].items():
            assert error < 1e-10, (rank, name, error)


@functools.cache
def _one_process_peak() -> int:
    return _activation_peak(0, 1)


def _dry_run_peak(cp: int) -> int:
    strategy = "hybrid" if cp > 1 else "single"
    layout = Layout.of(strategy, cp=cp, seq_len=MEMORY_SEQ, micro_batch=1, precision="32-true")
    return activation_peak(MEMORY_CONFIG, layout)


def test_activation_peak_shrinks_with_cp_and_the_dry_run_knows_it(
    ranks: list[dict[str, Any]],
) -> None:
    cp = len(ranks)
    one_process = _one_process_peak()
    assert _dry_run_peak(1) == pytest.approx(one_process, rel=0.05)
    measured = max(result["activation_peak"] for result in ranks)
    assert _dry_run_peak(cp) == pytest.approx(measured, rel=0.05)
    assert measured <= {2: 0.55, 4: 0.3}[cp] * one_process, (measured, one_process)


def test_per_rank_attention_flops_agree(ranks: list[dict[str, Any]]) -> None:
    flops = [result["flops"] for result in ranks]
    assert min(flops) > 0 and max(flops) / min(flops) <= 1.05, flops
