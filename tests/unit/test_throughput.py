"""TokenThroughputMonitor counts data-parallel replicas, not model-parallel ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from plugintrain.callbacks import TokenThroughputMonitor
from plugintrain.callbacks.throughput import _tokens_in_batch
from plugintrain.precision_plugins import FP32Precision


def _trainer(world_size: int, sampler: dict | None) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    if sampler is not None:
        strategy.distributed_sampler_kwargs = sampler
    return SimpleNamespace(
        precision_plugin=FP32Precision(),
        strategy=strategy,
        world_size=world_size,
        enable_validation=False,
        state=SimpleNamespace(stage=RunningStage.TRAINING),
    )


@pytest.mark.parametrize(
    ("world_size", "sampler", "replicas"),
    [
        (8, {"num_replicas": 2, "rank": 0}, 2),  # dp2 x tp2 x pp2: 4 ranks per replica
        (4, {"num_replicas": 4, "rank": 1}, 4),  # plain data parallelism
        (1, None, 1),  # single device: no sampler kwargs
    ],
)
def test_global_figures_count_replicas(
    world_size: int, sampler: dict | None, replicas: int
) -> None:
    monitor = TokenThroughputMonitor()
    monitor.setup(_trainer(world_size, sampler), None, TrainerFn.FITTING)
    throughput = monitor._throughputs[RunningStage.TRAINING]
    assert throughput.world_size == replicas


def test_mfu_peak_is_a_whole_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPUs have no known peak; give the device one to see it scaled to a replica's 4 ranks.
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda *_: 1e12)
    monitor = TokenThroughputMonitor()
    monitor.setup(_trainer(8, {"num_replicas": 2, "rank": 0}), None, TrainerFn.FITTING)
    assert monitor._throughputs[RunningStage.TRAINING].available_flops == 4e12


def test_tokens_are_counted_for_token_batches() -> None:
    assert _tokens_in_batch((torch.zeros(4, 16, dtype=torch.long), None)) == 64
    assert _tokens_in_batch((torch.zeros(4, 1, 28, 28), None)) == 4
