"""A model family needs only the declared contract to run under every model-parallel strategy.

``ToyLM`` is not the zoo's ``CausalLM``: its own module names (``embedding``, ``lm_head``,
``final_norm``, blocks of ``up``/``down``), its own shape dataclass and plan. It implements
:class:`plugintrain.core.contracts.ParallelModule` and its model
:class:`~plugintrain.core.contracts.StagedModel`, nothing else; under ``hybrid`` with
tensor_parallel=2 and under ``pipeline`` with pipeline_parallel=2 it must give the
losses and final weights of one plain process. One spawn of two ranks runs both.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.core.contracts import ParallelModule, StagedModel
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import HybridParallelStrategy, PipelineStrategy

from _harness import run_distributed
from _toy import ToyLM, ToyModel, ToyShape

STEPS = 3
BATCH = 4
SEQ = 8


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach().item())


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, ToyShape.vocab_size, (STEPS * BATCH, SEQ + 1), generator=gen)
    return TensorDataset(data[:, :-1], data[:, 1:])


def _fit(strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = ToyLM()
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, plugins=[FP32Precision()],
        max_steps=STEPS, gradient_clip_val=0.5, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses],
    )  # fmt: skip
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH))
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }
    return {"losses": losses.losses, "params": params}


LAYOUTS = {
    "hybrid-tp2": lambda: HybridParallelStrategy(tensor_parallel=2),
    "pipeline-pp2-1f1b": lambda: PipelineStrategy(pipeline_parallel=2, microbatches=2),
}


def _run_layouts(rank: int, world_size: int) -> dict[str, Any]:
    return {name: _fit(make(), devices=world_size) for name, make in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_run_layouts, 2, timeout=600)


@functools.cache
def _reference() -> dict[str, Any]:
    return _fit()


def test_toy_implements_only_the_contract() -> None:
    assert isinstance(ToyLM(), ParallelModule)
    assert isinstance(ToyModel(ToyShape()), StagedModel)
    assert not any(hasattr(ToyLM(), name) for name in ("generate", "flops_per_token"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_toy_model_matches_single_process(runs: list[dict[str, Any]], layout: str) -> None:
    reference = _reference()
    seen: set[str] = set()
    for rank_results in runs:
        got = rank_results[layout]
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
        for name, param in got["params"].items():
            torch.testing.assert_close(
                param, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name
            )
        seen |= set(got["params"])
    assert seen == set(reference["params"]), "the ranks together hold the whole model"
