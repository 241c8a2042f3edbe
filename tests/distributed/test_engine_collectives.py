"""The gradient engine's collectives on gloo: the same order on every rank, and the
tensor-parallel sum of partial gradients once per step.

- A parameter unused on one rank only (its gradient never arrives there) used to let that
  rank launch its other buckets first, in another order than its peers: a hang or a
  wrong sum on NCCL, a size mismatch or a wrong sum on gloo. Buckets now launch in bucket
  order, the unused gradient counting as zero, so training equals a reference that
  averages the ranks' gradients with a zero for it.
- Sequence-parallel norm weights (replicated, used on sequence shards) get gradients
  ``Partial`` over tp. They are summed over tp once per step (one all-reduce for the
  bucket) instead of inside every gradient hook of every micro-batch.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from _dtensors import full_grads
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from plugintrain.model_zoo import Transformer, TransformerConfig, llama3
from plugintrain.strategies import (
    GradientEngine,
    ParallelDims,
    apply_tensor_parallel,
    parallelize,
    vocab_parallel_loss,
)

from _harness import run_distributed

STEPS = 3
STAGES = (0, 1, 2)


class _Net(nn.Module):
    """An MLP plus a branch that only rank 0 uses; registered last, so its bucket is the
    first one reduced."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.extra = nn.Linear(5, 3)

    def forward(self, x: Tensor, use_extra: bool) -> Tensor:
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


def _data(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def _unused_on_rank_1(rank: int, world_size: int) -> dict[int, dict[str, Tensor]]:
    results = {}
    for stage in STAGES:
        net = _Net()
        engine = GradientEngine(net.named_parameters(), stage=stage, bucket_size_mb=1 / 16384)
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
        engine.attach(optimizer)
        for step in range(STEPS):
            x, y = _data(step, rank)
            F.mse_loss(net(x, use_extra=rank == 0), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[stage] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return results


def _reference() -> dict[str, Tensor]:
    """One process: each step's gradient is the mean of the two ranks', rank 1 adding a
    zero gradient for the branch it did not use."""
    net = _Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            x, y = _data(step, rank)
            net.zero_grad()
            F.mse_loss(net(x, use_extra=rank == 0), y).backward()
            grads.append(
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
            )
        for param, pair in zip(net.parameters(), zip(*grads, strict=True), strict=True):
            param.grad = (pair[0] + pair[1]) / 2
        optimizer.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_a_parameter_unused_on_one_rank_counts_as_a_zero_gradient() -> None:
    reference = _reference()
    for rank_results in run_distributed(_unused_on_rank_1, 2, timeout=120):
        for stage in STAGES:
            for name, param in rank_results[stage].items():
                torch.testing.assert_close(param, reference[name], msg=f"stage {stage}: {name}")


# ---- sequence-parallel norm gradients: one tp all-reduce per step --------------------------

SEQ, VOCAB, BATCH = 16, 64, 2


def _llama() -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "llama3-debug", n_layer=2, vocab_size=VOCAB, n_embd=32, block_size=SEQ, n_kv_head=4
    )
    return Transformer(config)


def _microbatches(count: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (count, BATCH, SEQ + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _accumulate(model: nn.Module, engine: GradientEngine | None, count: int) -> Counter:
    """``count`` micro-batches, all but the last under ``no_sync``; the collectives of their
    backward passes (where the engine's hooks and end-of-backward reduction run)."""
    loss_fn = vocab_parallel_loss(_loss)
    counts: Counter = Counter()
    for index, (x, y) in enumerate(_microbatches(count)):
        last = index == count - 1
        accumulating = engine.no_sync() if engine is not None and not last else nullcontext()
        loss = loss_fn(model(x), y) / count
        with accumulating, loss_parallel(), CommDebugMode() as comms:
            loss.backward()
        counts.update({str(op): n for op, n in comms.get_comm_counts().items()})
    return counts


def _engine_grads(model: nn.Module, engine: GradientEngine) -> dict[str, Tensor]:
    """Each parameter's reduced gradient, whole (dp = 1: every shard covers its tensor)."""
    grads = {}
    for entry in engine._layout.entries.values():
        local = entry.param.to_local() if isinstance(entry.param, DTensor) else entry.param
        grad = entry.shard.grad.view_as(local)
        if isinstance(entry.param, DTensor):
            grad = DTensor.from_local(grad, entry.param.device_mesh, entry.param.placements)
            grad = grad.full_tensor()
        grads[entry.name] = grad.clone()
    return grads


def _sp_counts(rank: int, world_size: int) -> dict[tuple[int, int], dict]:
    dims0 = ParallelDims(world_size, tensor_parallel=2, sequence_parallel=True)
    mesh = dims0.build_mesh()
    results = {}
    for stage in (0, 2):
        dims = ParallelDims(world_size, tensor_parallel=2, sequence_parallel=True, zero_stage=stage)
        for count in (2, 3):
            reference = _llama()
            apply_tensor_parallel(reference, llama3.tp_plan(), mesh["tp"], True)
            plain = _accumulate(reference, None, count)
            model = _llama()
            engine = parallelize(model, llama3.tp_plan(), dims, mesh, bucket_size_mb=64)
            comms = _accumulate(model, engine, count)
            results[(stage, count)] = {
                "counts": dict(comms),
                "plain": dict(plain),
                "buckets": engine.num_buckets,
                "grads": _engine_grads(model, engine),
                "reference": full_grads(reference),
            }
    return results


def test_sequence_parallel_norm_gradients_are_summed_once_per_step() -> None:
    """tp = 2 with SP (dp = 1), 2 and 3 micro-batches: the engine adds one all-reduce over
    tp for the whole step (plus, at ZeRO-0, its dp all-reduce of the one bucket), and no
    per-micro-batch redistribution; the gradients are the tp model's own, summed."""
    for rank_results in run_distributed(_sp_counts, 2, timeout=300):
        for (stage, count), got in rank_results.items():
            assert got["buckets"] == 1
            dp_all_reduces = 1 if stage == 0 else 0
            assert got["counts"].get("c10d.allreduce_", 0) == dp_all_reduces + 1, (stage, count)
            functional = {k: v for k, v in got["counts"].items() if not k.startswith("c10d.")}
            assert functional == got["plain"], (stage, count)  # the model's own, no more
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, got["reference"][name], msg=name)
