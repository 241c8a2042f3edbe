"""Activation recomputation under every plugintrain strategy, on gloo, at world size 2.

Each layout (tp=2 with sequence parallelism, pp=2 with 1F1B, FSDP2 over dp=2, ZeRO-2 over
dp=2) fits the same Llama-architecture CausalLM for a few SGD steps through Lightning
with ``activation_checkpointing`` none, full and selective. Against one process without
recomputation (Lightning's default strategy, the reference), the final weights match to
fp32 tolerance: the same gradients every step. The first step's peak of live tensor
bytes on each rank, measured by :class:`~plugintrain.core.memory.LiveTensorMemory`, falls from
none to selective to full. The model has 4 blocks, 2 per pipeline stage: a stage running
one block with one micro-batch in flight cannot lower its peak, since the block's backward
needs all of its activations at once, recomputed or kept. Processes start once; every
fit runs inside them.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
from _dtensors import full_params
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import HybridParallelStrategy, PipelineStrategy, ZeroStrategy

from _harness import run_distributed

WORLD = 2
STEPS = 2
BATCH = 4
SEQ = 64
VOCAB = 64
MODES = ("none", "full", "selective")
TIED = {"model.output.weight": "model.tok_embeddings.weight"}
# Layout -> (strategy factory taking the recomputation mode, data-parallel degree).
LAYOUTS = {
    "tp2+sp": (lambda mode: HybridParallelStrategy(
        tensor_parallel=2, sequence_parallel=True, activation_checkpointing=mode), 1),
    "pp2": (lambda mode: PipelineStrategy(
        pipeline_parallel=2, microbatches=2, activation_checkpointing=mode), 1),
    "fsdp2": (lambda mode: HybridParallelStrategy(
        zero_stage=3, activation_checkpointing=mode), 2),
    "zero2": (lambda mode: ZeroStrategy(
        stage=2, bucket_size_mb=0.01, activation_checkpointing=mode), 2),
}  # fmt: skip


def _config() -> TransformerConfig:
    return TransformerConfig.from_name(
        "llama3-debug", n_layer=4, vocab_size=VOCAB, n_embd=64, block_size=SEQ
    )


def _data() -> TensorDataset:
    tokens = torch.randint(
        0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class _FirstStepPeak(Callback):
    """Peak live bytes of the first training batch (forward, backward, step)."""

    def __init__(self) -> None:
        self.memory: LiveTensorMemory | None = None
        self.peak = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if index == 0:
            self.memory = LiveTensorMemory().__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self.memory is not None:
            self.memory.__exit__(None, None, None)
            self.peak, self.memory = self.memory.peak_bytes, None


def _fit(strategy: Any = "auto", dp: int = 1, dp_rank: int = 0) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    optimizer = functools.partial(torch.optim.SGD, lr=0.5)
    module = CausalLM(_config(), optimizer, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
    data = _data()
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    peak = _FirstStepPeak()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else WORLD, strategy=strategy,
        plugins=[FP32Precision()], max_steps=STEPS, callbacks=[peak],
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=BATCH // dp, sampler=sampler))
    weights = full_params(module)
    return {"weights": weights, "peak": peak.peak}


def _runs(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    results = {}
    for layout, (factory, dp) in LAYOUTS.items():
        for mode in MODES:
            results[layout, mode] = _fit(factory(mode), dp, dp_rank=rank if dp > 1 else 0)
    return results


@pytest.fixture(scope="module")
def world2() -> dict[str, Any]:
    return {"reference": _fit()["weights"], "ranks": run_distributed(_runs, WORLD)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_match_one_process_without_recompute(
    world2: dict[str, Any], layout: str, mode: str
) -> None:
    reference = world2["reference"]
    for rank in world2["ranks"]:
        weights = rank[layout, mode]["weights"]
        assert weights
        for name, weight in weights.items():  # a pipeline rank holds its stage only
            # The last stage's head is its own copy of the tied embedding.
            want = reference[TIED.get(name, name)] if name not in reference else reference[name]
            torch.testing.assert_close(weight, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recompute_lowers_each_rank_s_measured_peak(world2: dict[str, Any], layout: str) -> None:
    for rank in world2["ranks"]:
        peaks = {mode: rank[layout, mode]["peak"] for mode in MODES}
        assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
