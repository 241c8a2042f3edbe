"""A small language model that implements only plugintrain's model/strategy contract.

Not the zoo's ``CausalLM``: its own module names (``embedding``, ``lm_head``,
``final_norm``, blocks of ``up``/``down``), its own shape dataclass and plan. ``ToyLM``
implements :class:`plugintrain.core.contracts.ParallelModule` and ``ToyModel``
:class:`~plugintrain.core.contracts.StagedModel`, nothing else. Its blocks save few
activations, so a pipeline's boundary tensors are a visible share of its memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
