"""A model family needs only the declared contract to run under every model-parallel strategy.

``ToyLM`` is not the zoo's ``CausalLM``: its own module names (``embedding``, ``lm_head``,
``final_norm``, blocks of ``up``/``down``), its own shape dataclass and plan. It implements
:class:`plugintrain.distributed.ParallelModule` and its model
:class:`~plugintrain.distributed.StagedModel`, nothing else; under ``hybrid`` with
tensor_parallel=2 and under ``pipeline`` with pipeline_parallel=2 it must give the
losses and final weights of one plain process. One spawn of two ranks runs both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.distributed import ParallelModule, StagedModel
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import HybridParallelStrategy, PipelineStrategy

from _harness import run_distributed

STEPS = 3
BATCH = 4
SEQ = 8


@dataclasses.dataclass(frozen=True)
class ToyShape:
    name: str = "toy"
    n_layer: int = 4
    n_embd: int = 16
    n_head: int = 2
    kv_heads: int = 2
    ffn_dim: int = 32
    vocab_size: int = 32


class ToyBlock(nn.Module):
    def __init__(self, shape: ToyShape) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(shape.n_embd)
        self.up = nn.Linear(shape.n_embd, shape.ffn_dim)
        self.down = nn.Linear(shape.ffn_dim, shape.n_embd)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class ToyModel(nn.Module):
    """A position-free MLP language model that implements ``StagedModel``."""

    def __init__(self, shape: ToyShape) -> None:
        super().__init__()
        self.embedding = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.layers = nn.ModuleDict({str(i): ToyBlock(shape) for i in range(shape.n_layer)})
        self.final_norm = nn.LayerNorm(shape.n_embd)
        self.lm_head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.embedding(tokens)

    def run_layers(self, h: Tensor, keys: Iterable[str], positions: Tensor) -> Tensor:
        for key in keys:
            h = self.layers[key](h)
        return h

    def head(self, h: Tensor) -> Tensor:
        return self.lm_head(self.final_norm(h))

    def keep_stage(self, layer_keys: Collection[str], first: bool, last: bool) -> None:
        for key in [k for k in self.layers if k not in layer_keys]:
            del self.layers[key]
        if not first:
            self.embedding = None
        if not last:
            self.final_norm, self.lm_head = None, None

    def tied_parameters(self) -> list[tuple[str, str]]:
        return []

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1))
        return self.head(self.run_layers(self.embed(tokens, positions), self.layers, positions))


class ToyLM(L.LightningModule):
    """Implements ``ParallelModule``: config, model, tp_plan, loss_fn, record_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ToyShape()
        self.model: ToyModel | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = ToyModel(self.config)

    def tp_plan(self) -> dict[str, str]:
        return {
            "model.embedding": "vocab_embedding",
            "model.layers.*.up": "colwise",
            "model.layers.*.down": "rowwise",
            "model.lm_head": "vocab_head",
        }

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def record_loss(self, stage: str, loss: Tensor, batch: Any) -> None:
        self.log(f"{stage}_loss", loss)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.record_loss("train", loss, batch)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-5)


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
