"""Mesh-aware precision on 2 gloo processes: found-inf agreement and global-norm clipping.

One spawn (``_harness.run_distributed``) runs every case, since process start-up dominates
on two cores. Nothing here is gloo-specific: on NCCL the same cases run with device tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from plugintrain.callbacks.precision_check import PrecisionCheck, tensor_stats
from plugintrain.core.contracts import GradientLayout, GradientPiece, default_gradient_layout
from plugintrain.precision_plugins import FP16MixedPrecision, clip_grads_by_global_norm_
from plugintrain.tools.compare import record_diverges

from _harness import run_distributed

WORLD_SIZE = 2
MAX_NORM = 1.0
# The model split across ranks: rank 0 holds "a", rank 1 holds "b", both hold "c".
HELD = {0: ("a", "c"), 1: ("b", "c")}
SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2)}


def _full_model() -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Parameters and targets of the whole model, identical on every rank."""
    generator = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=generator) * 3 for k, s in SHAPES.items()}
    targets = {k: torch.randn(s, generator=generator) for k, s in SHAPES.items()}
    return params, targets


def _reference_step(clip: bool = True) -> dict[str, Tensor]:
    """One SGD(lr=1) step of the whole model in one process, clipped by torch (or not)."""
    params, targets = _full_model()
    full = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    sum(((full[k] - targets[k]) ** 2).sum() for k in full).backward()
    if clip:
        nn.utils.clip_grad_norm_(full.values(), MAX_NORM)
    return {k: (p - p.grad).detach() for k, p in full.items()}


def _reference_grad_norm() -> float:
    """The whole model's gradient norm before clipping."""
    params, targets = _full_model()
    grads = [2 * (params[k] - targets[k]) for k in params]  # d/dp of sum((p - t)^2)
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


class _SplitModel(L.LightningModule):
    """This rank's share of the model; the loss is a sum of independent terms per parameter,
    so each held parameter's gradient equals its gradient in the whole model."""

    def __init__(self, rank: int, inf_at: int | None, fused: bool = False) -> None:
        super().__init__()
        params, targets = _full_model()
        self.held = nn.ParameterDict({k: nn.Parameter(params[k]) for k in HELD[rank]})
        self.targets = {k: targets[k] for k in HELD[rank]}
        self.inf_at = inf_at
        self.fused = fused
        self.history: list[dict[str, Tensor]] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = sum(((p - self.targets[k]) ** 2).sum() for k, p in self.held.items())
        return loss * math.inf if batch_idx == self.inf_at else loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.history.append({k: p.detach().clone() for k, p in self.held.items()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # fused=True: the optimizer Lightning's MixedPrecision refuses to clip for.
        return torch.optim.SGD(self.parameters(), lr=1.0, fused=self.fused)


class _SplitStrategy(SingleDeviceStrategy):
    """A stand-in for a model-parallel strategy: the world holds one model between it."""

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        replicated = {id(self.lightning_module.held["c"])}
        pieces = [
            GradientPiece(p.grad, WORLD_SIZE if id(p) in replicated else 1)
            for p in parameters
            if p.grad is not None
        ]
        return GradientLayout(group=dist.group.WORLD, pieces=pieces)


def _fit_split(model: _SplitModel, plugin: FP16MixedPrecision, steps: int) -> None:
    trainer = L.Trainer(
        strategy=_SplitStrategy(device="cpu"),
        plugins=[plugin],
        max_steps=steps,
        gradient_clip_val=MAX_NORM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(torch.zeros(steps, 1), batch_size=1))


def _assert_clipped_step(rank: int, stepped: dict[str, Tensor]) -> None:
    """``stepped`` is this rank's share of the step torch takes after clipping the whole
    model's gradients by their global norm; the step without clipping is another."""
    assert _reference_grad_norm() > 10 * MAX_NORM  # clipping must change this step
    clipped, unclipped = _reference_step(clip=True), _reference_step(clip=False)
    for name, value in stepped.items():
        torch.testing.assert_close(value, clipped[name])
        assert not torch.allclose(value, unclipped[name]), (rank, name)


def _case_found_inf_and_clipping(rank: int) -> None:
    plugin = FP16MixedPrecision(device="cpu", init_scale=1024.0, growth_interval=100)
    model = _SplitModel(rank, inf_at=1 if rank == 1 else None)
    _fit_split(model, plugin, steps=2)
    _assert_clipped_step(rank, model.history[0])  # step 0: clipped by the global norm
    for name, value in model.history[1].items():  # step 1: rank 1 overflowed, all skip
        assert torch.equal(value, model.history[0][name]), (rank, name)
    assert plugin.loss_scaler.scale == 512.0
    assert plugin.loss_scaler.skipped_steps == 1


def _case_clipping_with_a_fused_optimizer(rank: int) -> None:
    # Lightning's MixedPrecision refuses to clip for a fused optimizer (GradScaler leaves
    # unscaling to its step); ours unscales first, so the clip must happen, by the norm of
    # the whole split model, exactly as torch's clip_grad_norm_ does in one process.
    plugin = FP16MixedPrecision(device="cpu", init_scale=1024.0, growth_interval=100)
    model = _SplitModel(rank, inf_at=None, fused=True)
    _fit_split(model, plugin, steps=1)
    assert plugin.loss_scaler.skipped_steps == 0
    _assert_clipped_step(rank, model.history[0])


def _case_dtensor_default_layout(rank: int) -> None:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    generator = torch.Generator().manual_seed(1)
    full_grads = [torch.randn(4, 3, generator=generator), torch.randn(6, generator=generator)]
    params = [
        nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])),
        nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()])),
    ]
    for param, grad, placement in zip(params, full_grads, (Shard(0), Replicate()), strict=True):
        param.grad = distribute_tensor(grad, mesh, [placement])
    reference = [nn.Parameter(torch.zeros_like(g)) for g in full_grads]
    for ref, grad in zip(reference, full_grads, strict=True):
        ref.grad = grad.clone()
    unclipped = [g.clone() for g in full_grads]  # a replicated grad shares their memory
    expected_norm = nn.utils.clip_grad_norm_(reference, MAX_NORM)
    norm = clip_grads_by_global_norm_(default_gradient_layout(params), MAX_NORM)
    torch.testing.assert_close(norm, expected_norm)
    assert norm > 2 * MAX_NORM  # so the gradients below were scaled down
    for param, ref, before in zip(params, reference, unclipped, strict=True):
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad)
        assert not torch.allclose(param.grad.full_tensor(), before)


def _case_precision_check_gathers_dtensor(rank: int) -> None:
    torch.manual_seed(2)  # the same weights on every rank, so sharding splits one model
    reference = nn.Sequential(nn.Linear(4, 6))
    plan = {"0": ColwiseParallel(use_local_output=False)}  # output: DTensor Shard(-1)
    sharded = parallelize_module(copy.deepcopy(reference), init_device_mesh("cpu", (2,)), plan)
    check = PrecisionCheck(modules=["0"])
    check.attach(sharded)
    check.start_step(0)
    x = torch.randn(3, 4)
    sharded(x)
    recorded, expected = check.records[0], tensor_stats(reference(x))
    assert (recorded["dtype"], recorded["shape"]) == (expected["dtype"], expected["shape"])
    # Not bitwise (the hashes differ): a column-split GEMM rounds differently.
    assert not record_diverges(recorded, expected, rtol=1e-5)


def _all_cases(rank: int, world_size: int) -> None:
    assert world_size == WORLD_SIZE
    _case_found_inf_and_clipping(rank)
    _case_clipping_with_a_fused_optimizer(rank)
    _case_dtensor_default_layout(rank)
    _case_precision_check_gathers_dtensor(rank)


def test_precision_mesh_cases_on_two_processes() -> None:
    """Found-inf on one rank skips the step on all; split-model clipping (also for a fused
    optimizer) and DTensor clipping equal single-process clipping; PrecisionCheck records
    full logical tensors."""
    run_distributed(_all_cases, WORLD_SIZE)
