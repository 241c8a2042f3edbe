"""ZeRO-3 (FSDP2) under ``bf16-mixed``: bf16 gathered weights, fp32 shards, no autocast.

``HybridParallelStrategy(zero_stage=3)`` hands FSDP2 a ``MixedPrecisionPolicy`` from the
precision plugin (parameters all-gathered in bf16, gradients reduce-scattered in fp32)
and turns the plugin's autocast off, so the only bf16 weights are FSDP's. Two gloo ranks
fit a Llama debug model; the test checks what a Linear sees in forward (bf16 weights,
autocast off), what the optimizer steps (fp32 shards, fp32 state), and that the losses
stay close to one process under bf16 autocast (the same weights, computed in bf16 either
way; the difference is which operations autocast keeps in fp32).
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import BF16MixedPrecision
from plugintrain.strategies import HybridParallelStrategy

from _harness import run_distributed

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 16, 64


class _Seen(Callback):
    """Losses, and what a Linear layer sees at the start of each forward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.forward: list[tuple[torch.dtype, bool]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        def seen(module: torch.nn.Module, args: Any) -> None:
            weight = module.weight
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            self.forward.append((local.dtype, torch.is_autocast_enabled("cpu")))

        pl_module.model.layers["0"].attention.wq.register_forward_pre_hook(seen)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(
            trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        )


def _fit(strategy: Any, dp: int, rank: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    config = TransformerConfig.from_name(
        "llama3-debug", n_layer=2, vocab_size=VOCAB, n_embd=32, block_size=SEQ
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5)
    module = CausalLM(config, optimizer, warmup_steps=0, min_lr_ratio=1.0)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=gen)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=False)
    seen, plugin = _Seen(), BF16MixedPrecision()
    trainer = L.Trainer(
        accelerator="cpu", devices=dp, strategy=strategy, plugins=[plugin],
        max_steps=STEPS, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[seen],
    )  # fmt: skip
    trainer.fit(module, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, sampler=sampler))
    optimizer_state = trainer.optimizers[0].state.values()
    return {
        "losses": seen.losses,
        "forward": seen.forward,
        "params": {p.dtype for p in module.parameters()},
        "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "state": {v.dtype for state in optimizer_state for v in state.values() if v.dim() > 0},
        "autocast": plugin.autocast,
    }


def _zero3(rank: int, world_size: int) -> dict[str, Any]:
    return _fit(HybridParallelStrategy(zero_stage=3), world_size, rank)


def test_zero3_gathers_bf16_weights_and_steps_fp32_shards() -> None:
    reference = _fit("auto", 1, 0)  # one process, bf16 autocast over fp32 weights
    assert reference["forward"][0] == (torch.float32, True)
    for got in run_distributed(_zero3, 2, timeout=300):
        assert set(got["forward"]) == {(torch.bfloat16, False)}
        assert got["sharded"] and got["params"] == {torch.float32}
        assert got["state"] == {torch.float32} and not got["autocast"]
        # bf16 compute either way; autocast runs softmax, norms and the loss in fp32.
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=2e-3, atol=0.0)
