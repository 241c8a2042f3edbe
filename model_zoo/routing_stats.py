"""What the mixture-of-experts layers did in a training step, over every rank: expert
loads, imbalance, dropped tokens, balance loss, routing biases; and the bias update.

Each :class:`~plugintrain.model_zoo.moe.MoE` layer counts, on its rank, the tokens its
router sent to each expert during the step's training forwards. After the optimizer
step, :func:`reduce_routing` sums one small table ``(n_layer, E + 5)`` over the whole
world (every rank fills the rows of the layers it holds, zeros elsewhere, so pipeline
stages join the same collective) and divides by the number of ranks holding each layer.
Ranks of one layer see disjoint tokens (data and expert parallelism, sequence shards)
or the same ones (tensor parallelism without SP); either way each expert's count is
the global count times one factor per layer, which neither the shares, nor the
imbalance ``max / mean``, nor the sign of DeepSeek-V3's bias update depends on. Every
rank then applies the same update to the biases it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from plugintrain.model_zoo.moe import MoE

_EXTRA = 5
"""Columns after the expert counts: dropped tokens, balance-loss sum, forwards, the
routing bias's L2 norm, and 1 (the rank holds the layer)."""


@dataclass(frozen=True)
class RoutingStats:
    """One optimizer step of routing, per MoE layer (rows: full-model layer indices)."""

    layers: list[int]
    """Full-model indices of the MoE layers."""
    load: Tensor
    """``(len(layers), E)``: each expert's share of the layer's routed assignments."""
    dropped: Tensor
    """``(len(layers),)``: share of the layer's assignments dropped by the capacity."""
    aux_loss: Tensor
    """``(len(layers),)``: the layer's mean balance loss per forward (0 when off)."""
    bias_norm: Tensor
    """``(len(layers),)``: L2 norm of the layer's routing bias."""

    @property
    def imbalance(self) -> Tensor:
        """``(len(layers),)``: the busiest expert's load over the mean load (1: balanced)."""
        return self.load.max(dim=1).values * self.load.size(1)

    def metrics(self) -> dict[str, float]:
        """Scalars under stable TensorBoard tags: ``moe/imbalance`` (mean over layers),
        ``moe/imbalance_max``, ``moe/dropped_fraction``, ``moe/aux_loss`` (summed over
        layers), ``moe/bias_norm`` (over all layers), and per layer
        ``moe/layer<i>/imbalance``, ``.../bias_norm``, ``.../min_load``, ``.../max_load``
        (an expert's share of the assignments; ``1 / E`` when balanced)."""
        imbalance, load = self.imbalance.tolist(), self.load.tolist()  # one copy each
        bias_norm = self.bias_norm.tolist()
        out = {
            "moe/imbalance": sum(imbalance) / len(imbalance),
            "moe/imbalance_max": max(imbalance),
            "moe/dropped_fraction": float(self.dropped.mean()),
            "moe/aux_loss": float(self.aux_loss.sum()),
            "moe/bias_norm": sum(n * n for n in bias_norm) ** 0.5,
        }
        for row, layer in enumerate(self.layers):
            prefix = f"moe/layer{layer}"
            out[f"{prefix}/imbalance"] = imbalance[row]
            out[f"{prefix}/bias_norm"] = bias_norm[row]
            out[f"{prefix}/min_load"] = min(load[row])
            out[f"{prefix}/max_load"] = max(load[row])
        return out


def _local_table(
    layers: dict[int, MoE], n_layer: int, experts: int, device: torch.device
) -> Tensor:
    table = torch.zeros(n_layer, experts + _EXTRA, dtype=torch.float64, device=device)
    for index, moe in layers.items():
        row = table[index]
        row[:experts] = moe.tokens_per_expert.double()
        row[experts] = moe.dropped_tokens.double()
        row[experts + 1] = moe.aux_loss_sum.double()
        row[experts + 2] = moe.forwards.double()
        row[experts + 3] = moe.router.expert_bias.double().norm()
        row[experts + 4] = 1.0  # this rank holds the layer
    return table


def reduce_routing(
    layers: dict[int, MoE],
    n_layer: int,
    experts: int,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> RoutingStats:
    """Sum the step's routing counters over ``group`` (default: the world, when
    initialized) in one all-reduce, and describe them; every rank of the group must call
    it, with the same ``n_layer`` and ``experts``.

    Args:
        layers: This rank's MoE layers by full-model index (may be empty on a pipeline
            stage without any).
        n_layer: The model's layer count (rows of the shared table).
        experts: Routed experts per MoE layer (``config.moe.n_routed_experts``).
        device: Where the table lives (the model's device; the collective's backend must
            take it); default: the layers' device, or the CPU.
        group: The ranks to sum over.
    """
    if device is None:
        first = next(iter(layers.values()), None)
        device = first.tokens_per_expert.device if first is not None else torch.device("cpu")
    table = _local_table(layers, n_layer, experts, device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(table, group=group)
    table = table.cpu()  # a handful of scalars per layer: read them once, on the host
    held = table[:, experts + 4] > 0
    rows = table[held]
    holders = rows[:, experts + 4]
    counts = rows[:, :experts]
    assigned = counts.sum(dim=1).clamp(min=1)
    return RoutingStats(
        layers=held.nonzero().flatten().tolist(),
        load=(counts / assigned[:, None]).float(),
        dropped=(rows[:, experts] / assigned).float(),
        aux_loss=(rows[:, experts + 1] / rows[:, experts + 2].clamp(min=1)).float(),
        bias_norm=(rows[:, experts + 3] / holders).float(),  # the same on every holder
    )


def update_biases(layers: dict[int, MoE], stats: RoutingStats) -> None:
    """DeepSeek-V3's auxiliary-loss-free step on every layer held here, from the loads
    in ``stats`` (the same on every rank)."""
    rows = {layer: row for row, layer in enumerate(stats.layers)}
    for index, moe in layers.items():
        if moe.moe.bias_update_rate > 0:
            moe.update_bias(stats.load[rows[index]])


def routing_step(
    layers: dict[int, MoE], n_layer: int, experts: int, device: torch.device | None = None
) -> RoutingStats:
    """After an optimizer step: reduce the step's routing counters over the world, move
    the routing biases and zero the counters; the statistics to log (see
    :meth:`RoutingStats.metrics`). Every rank must call it."""
    stats = reduce_routing(layers, n_layer, experts, device)
    update_biases(layers, stats)
    for moe in layers.values():
        moe.reset_counts()
    return stats


def add_load_histograms(experiment: object, stats: RoutingStats, step: int) -> None:
    """Each layer's tokens per expert (as shares of its assignments) as a TensorBoard
    histogram ``moe/layer<i>/tokens_per_expert`` (``experiment``: a ``SummaryWriter``)."""
    for row, layer in enumerate(stats.layers):
        experiment.add_histogram(f"moe/layer{layer}/tokens_per_expert", stats.load[row], step)


class RoutingHooks:
    """LightningModule mixin: after each optimizer step of a mixture-of-experts model (its
    ``config.moe`` set, its ``model`` a :class:`~plugintrain.model_zoo.Transformer`), the
    step's routing over every rank, logged under ``moe/*`` (expert loads and a
    ``tokens_per_expert`` histogram per layer, imbalance, dropped tokens, balance loss,
    bias norms), and DeepSeek-V3's routing-bias update.

    It runs inside ``optimizer_step``, right after the step: before any callback's
    ``on_train_batch_end`` (a checkpoint saved there holds the updated biases, so a resumed
    run routes exactly as the uninterrupted one), once per step whatever the gradient
    accumulation, on every rank.
    """

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's optimizer step, then the routing step (see the class)."""
        super().optimizer_step(*args, **kwargs)
        if self.config.moe is None:
            return
        layers = {int(key): moe for key, moe in self.model.moe_layers()}
        experts = self.config.moe.n_routed_experts
        stats = routing_step(layers, self.config.n_layer, experts, self.device)
        self.log_dict(stats.metrics(), on_step=True, on_epoch=False)
        step = self.trainer.global_step  # counts the step just taken
        logs_now = step % self.trainer.log_every_n_steps == 0  # histograms at the scalars' pace
        if isinstance(self.logger, TensorBoardLogger) and self.trainer.is_global_zero and logs_now:
            add_load_histograms(self.logger.experiment, stats, step)
