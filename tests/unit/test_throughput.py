"""TokenThroughputMonitor counts data-parallel replicas, not model-parallel ranks, and
divides by dense peaks; the training FLOPs per token match torch's FLOP counter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from plugintrain.callbacks import TokenThroughputMonitor
from plugintrain.callbacks.throughput import _tokens_in_batch
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.peak_flops import dense_peak_flops
from plugintrain.precision_plugins import BF16MixedPrecision, FP32Precision


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
