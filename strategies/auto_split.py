"""``layers_per_stage: auto`` as a strategy sets up: global rank 0 times a one-block model
(:mod:`~plugintrain.strategies.balance`), every rank takes its figures and the split with
the shortest simulated step, and rank 0 logs the choice."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from plugintrain.core.contracts import MicroBatchShape, OneBlockModule, check_contract
from plugintrain.strategies import balance
from plugintrain.strategies.balance import MEASURED_TOKENS, Balance, LayerCosts, choose_split
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline_stages import PipelineOptions

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision


def rank_0_costs(
    module: OneBlockModule,
    vocab_size: int,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    precision_plugin: Any,
) -> LayerCosts:
    """Global rank 0 measures and every rank receives its figures (a broadcast of six
    numbers): timings differ between ranks, and a split that differed would deadlock.

    At most :data:`MEASURED_TOKENS` tokens go through the head (its logits are the largest
    tensor of the measurement), and the costs are scaled to the micro-batch: scaling every
    cost alike changes no choice. A failure on rank 0 is raised on every rank, rather than
    leaving the others waiting in the broadcast.
    """
    values, error = torch.full((6,), math.nan, dtype=torch.float64), None
    if not dist.is_initialized() or dist.get_rank() == 0:
        sequences = max(1, min(micro_batch, MEASURED_TOKENS // seq_len))
        try:
            costs = balance.measure_one_block(  # the module's: tests stand in for it
                module.one_block_model, vocab_size, sequences, seq_len, device, precision_plugin
            )
            values = costs.scaled(micro_batch / sequences).as_tensor()
        except Exception as failure:  # raised below, on every rank
            error = failure
    if dist.is_initialized():
        values = values.to(device)
        dist.broadcast(values, src=0)
    if torch.isnan(values).any():
        raise RuntimeError(
            "layers_per_stage=auto: global rank 0 could not time the stages (its log has the"
            " error); give layers_per_stage as block counts per stage instead"
        ) from error
    return LayerCosts.from_tensor(values.cpu())


def balance_stages(
    module: Any,
    dims: ParallelDims,
    options: PipelineOptions,
    datamodule: Any,
    device: torch.device,
    precision_plugin: Precision,
) -> PipelineOptions:
    """``options`` with ``layers_per_stage: auto`` replaced by the split chosen from costs
    measured on this device (global rank 0's, on every rank) for ``module`` (a
    :class:`~plugintrain.core.contracts.ParallelModule` and
    :class:`~plugintrain.core.contracts.OneBlockModule`); logged on rank 0."""
    check_contract(module, OneBlockModule, "layers_per_stage=auto")
    batch_size, seq_len = _micro_batch_shape(datamodule)
    micro = batch_size // options.microbatches
    config = module.config
    costs = rank_0_costs(module, config.vocab_size, micro, seq_len, device, precision_plugin)
    pp, vpp = dims.pipeline_parallel, dims.virtual_pipeline_parallel
    balance = choose_split(costs, config.n_layer, pp, vpp, options.schedule, options.microbatches)
    rank_zero_info(_describe(balance, costs))
    return dataclasses.replace(options, layers_per_stage=balance.layers_per_stage)


def _micro_batch_shape(datamodule: Any) -> tuple[int, int]:
    if not (
        isinstance(datamodule, MicroBatchShape)
        and isinstance(datamodule.batch_size, int)
        and isinstance(datamodule.seq_len, int)
    ):
        raise ValueError(
            "layers_per_stage=auto times a micro-batch of the datamodule's batch_size and"
            f" seq_len, and {type(datamodule).__name__} has no integer batch_size and seq_len;"
            " give layers_per_stage as a list of block counts per stage instead"
        )
    return datamodule.batch_size, datamodule.seq_len


def _describe(balance: Balance, costs: LayerCosts) -> str:
    ms = [f"{1000 * f:.2f}/{1000 * b:.2f}" for f, b in (costs.embed, costs.block, costs.head)]
    equal = balance.equal_step_seconds
    versus = "" if equal is None else f"; equal split {1000 * equal:.1f} ms"
    bubble = float(balance.simulation.bubble_fraction)
    return (
        f"layers_per_stage=auto: chose {list(balance.layers_per_stage)} (simulated step"
        f" {1000 * balance.step_seconds:.1f} ms, bubble {bubble:.1%}"
        f"{versus}) from forward/backward ms per micro-batch: embedding {ms[0]}, block"
        f" {ms[1]}, head + loss {ms[2]}"
    )
