"""TokenThroughputMonitor counts data-parallel replicas, not model-parallel ranks, divides
by dense peaks, and synchronizes the device only on the batches it logs, with rates still
equal to the tokens between logged points over the time between them; the training FLOPs
per token match torch's FLOP counter."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, throughput_monitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from plugintrain.callbacks import TokenThroughputMonitor, throughput
from plugintrain.callbacks.throughput import _timed_points, _tokens_in_batch
from plugintrain.core.peak_flops import dense_peak_flops
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import BF16MixedPrecision, FP32Precision


def _trainer(world_size: int, sampler: dict | None) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    if sampler is not None:
        strategy.distributed_sampler_kwargs = sampler
    return SimpleNamespace(
        precision_plugin=FP32Precision(),
        strategy=strategy,
        world_size=world_size,
        log_every_n_steps=50,
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


# Device names as `torch.cuda.get_device_name` reports them, with the dense bf16 peak of
# the chip's datasheet (the "with sparsity" figures halved).
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": 989.4e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.4e12,
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA GH200 480GB": 989.4e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A10": 125e12,
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L4": 121e12,
}


@pytest.mark.parametrize(("name", "bf16"), DEVICE_NAMES.items())
def test_dense_peaks_by_device_name(name: str, bf16: float) -> None:
    assert dense_peak_flops(name, torch.bfloat16) == bf16
    assert dense_peak_flops(name, torch.float16) == bf16
    # fp32 matmuls at the TF32 rate (half the bf16 one on these chips) when torch allows it.
    assert dense_peak_flops(name, torch.float32, tf32=True) == pytest.approx(bf16 / 2, rel=0.02)
    assert dense_peak_flops(name, torch.float32) < dense_peak_flops(name, torch.float32, True)


def test_unknown_devices_and_types_have_no_peak() -> None:
    assert dense_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # rates not published
    assert dense_peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert dense_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16
    assert dense_peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_monitor_takes_the_dense_peak_of_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning 2.6 finds no peak for this name; the dense table does.
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    trainer = _trainer(8, {"num_replicas": 2, "rank": 0})
    trainer.strategy.root_device = torch.device("cuda", 0)
    trainer.precision_plugin = BF16MixedPrecision()
    monitor = TokenThroughputMonitor()
    monitor.setup(trainer, None, TrainerFn.FITTING)
    assert monitor._throughputs[RunningStage.TRAINING].available_flops == 4 * 989.4e12


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug", "qwen3-debug"])
@pytest.mark.parametrize("seq_len", [64, 256])
def test_training_flops_per_token_match_torch_flop_counter(preset: str, seq_len: int) -> None:
    """MFU's numerator (``TransformerConfig.flops_per_token``) against torch's
    FlopCounterMode over forward + backward, within 5%. Attention runs on the math kernel,
    whose matmuls the counter sees (it has no formula for CPU's fused kernel); like the
    formula it counts the causal scores in full."""
    config = TransformerConfig.from_name(preset, vocab_size=512, block_size=256)
    torch.manual_seed(0)
    module = CausalLM(config)
    module.configure_model()
    tokens = torch.randint(0, 512, (2, seq_len))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        module.loss_fn(module(tokens), tokens).backward()
    counted = counter.get_total_flops() / tokens.numel()
    assert counted == pytest.approx(config.flops_per_token(seq_len), rel=0.05)


# ---- synchronizing only on logged batches ----------------------------------------------

TOKENS_PER_BATCH = 2 * 8  # (B, T) token ids
FLOPS_PER_BATCH = 1000
TRAIN_SECONDS = 1.0  # a training batch on the fake clock
VAL_SECONDS = 50.0  # a validation batch: must not count as training time


class _TokenModel(L.LightningModule):
    """The smallest module with token batches and ``flops_per_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 4)
        self.flops_per_batch = FLOPS_PER_BATCH

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        return self.embedding(batch[0]).square().mean()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        self.embedding(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FakeClock(Callback):
    """``time.perf_counter`` that advances by a known time per batch: the true rates are
    known whenever the monitor reads it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.train_batches = 0

    def on_train_batch_start(self, *_: Any) -> None:
        self.now += TRAIN_SECONDS
        self.train_batches += 1

    def on_validation_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if not trainer.sanity_checking:
            self.now += VAL_SECONDS


class _Metrics(Logger):
    """Keeps what is logged, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *_: Any, **__: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


def _fit_with_fake_clock(
    monkeypatch: pytest.MonkeyPatch, accumulate: int
) -> tuple[list[int], list[dict[str, float]], int]:
    """Fit 12 optimizer steps, logging every 3 and validating every 6; returns the training
    batches started at each synchronization, the training throughput records, and the
    batches run."""
    clock, metrics, synced = _FakeClock(), _Metrics(), []
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(
        throughput, "_synchronize", lambda device: synced.append(clock.train_batches)
    )
    tokens = torch.randint(0, 16, (64, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens, tokens), batch_size=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=12,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=3,
        val_check_interval=6 * accumulate,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[TokenThroughputMonitor(window_size=2), clock],
        logger=metrics,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_TokenModel(), loader, loader)
    records = [m for _, m in metrics.logged if "throughput/tokens" in m]
    return synced, records, clock.train_batches


@pytest.mark.parametrize("accumulate", [1, 2])
def test_synchronizes_only_on_logged_batches(
    monkeypatch: pytest.MonkeyPatch, accumulate: int
) -> None:
    synced, records, batches = _fit_with_fake_clock(monkeypatch, accumulate)
    logged_batches = [int(r["throughput/batches"]) for r in records]
    # Every 3rd optimizer step is logged: batches 3, 6, 9, 12 (x accumulate).
    assert logged_batches == [3 * accumulate * k for k in (1, 2, 3, 4)]
    assert batches == 12 * accumulate
    # A synchronization for each logged batch, plus one as each validation starts and
    # ends (after steps 6 and 12): 8 for 12 steps, not one per batch.
    validations = [6 * accumulate, 12 * accumulate]
    expected = sorted([*logged_batches, *validations, *validations])
    assert synced == expected


@pytest.mark.parametrize("accumulate", [1, 2])
def test_rates_are_over_the_span_between_logged_batches(
    monkeypatch: pytest.MonkeyPatch, accumulate: int
) -> None:
    _, records, _ = _fit_with_fake_clock(monkeypatch, accumulate)
    rated = [r for r in records if "throughput/device/tokens_per_sec" in r]
    assert len(rated) == 3  # from the second logged point on (the window holds two)
    for record in rated:
        # Validation batches (50 s each on the clock) are not in the training time.
        assert record["throughput/device/tokens_per_sec"] == TOKENS_PER_BATCH / TRAIN_SECONDS
        assert record["throughput/device/batches_per_sec"] == 1 / TRAIN_SECONDS
        assert record["throughput/device/flops_per_sec"] == FLOPS_PER_BATCH / TRAIN_SECONDS
    assert records[-1]["throughput/tokens"] == 12 * accumulate * TOKENS_PER_BATCH


def test_window_counts_logged_points() -> None:
    assert _timed_points(2, 1) == 2  # Lightning's window of 2 when logging every step
    assert _timed_points(20, 1) == 20
    assert _timed_points(20, 50) == 2  # one logging interval already spans 50 steps
    assert _timed_points(20, 5) == 5  # four intervals: 20 steps >= 19
    assert _timed_points(20, 0) == 2  # nothing logged


def test_synchronizes_cuda_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", calls.append)
    throughput._synchronize(torch.device("cpu"))
    throughput._synchronize(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]
