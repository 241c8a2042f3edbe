"""A Lightning run under a plugintrain strategy, for ``test_zero.py`` (run as a script).

Lightning launches the other ranks itself by re-running this script (``popen``, as
``ddp`` does). Rank 0 writes the rank-averaged loss of every step as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import plugintrain.strategies
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import FP32Precision

plugintrain.strategies.register()  # zero1, zero2, hybrid, ... by name

GLOBAL_BATCH = 8
SAMPLES = 16  # one epoch = 2 optimizer steps
EPOCHS = 2
SEQ = 16


class _LossRecorder(Callback):
    """The loss of each step averaged over ranks: the loss of the global batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(trainer.callback_metrics["val_loss"].item())

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses.append(loss.item())


def _data(devices: int) -> DataLoader:
    tokens = torch.randint(0, 97, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(7))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return DataLoader(dataset, batch_size=GLOBAL_BATCH // devices)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--validate", default=None, help="a checkpoint to validate after fit")
    args = parser.parse_args()
    L.seed_everything(0)
    config = dataclasses.replace(
        TransformerConfig.from_name("gpt2-debug"),
        vocab_size=97,
        n_layer=2,
        n_embd=32,
        block_size=SEQ,
    )
    model = CausalLM(
        config,
        functools.partial(torch.optim.AdamW, lr=3e-3),
        warmup_steps=0,
        lr_decay_steps=8,
        min_lr_ratio=1.0,
    )
    recorder = _LossRecorder()
    # Epoch-end checkpoints: Lightning restarts a plain DataLoader's epoch from its first
    # batch on resume, so only an epoch boundary continues the uninterrupted data order.
    checkpoint = ModelCheckpoint(args.root / "ckpt", "{step}", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        # 4 steps, stopped by epochs rather than `max_steps=4`: with `max_steps`, Lightning
        # 2.6 resumes an end-of-epoch checkpoint as a restart "on epoch end" of that epoch,
        # trains one more batch in it (the first of a fresh iterator), then starts another
        # epoch from its first batch, so the second resumed step trains another batch than
        # the uninterrupted run. With `max_epochs` it resumes at the next epoch's start.
        max_epochs=EPOCHS,
        gradient_clip_val=0.5,
        plugins=[FP32Precision()],
        callbacks=[recorder, checkpoint],
        default_root_dir=args.root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val = _data(args.devices) if args.validate else None  # then validated after each epoch
    trainer.fit(model, _data(args.devices), val, ckpt_path=args.resume)
    out = {"losses": recorder.losses, "logged": "train_loss" in trainer.callback_metrics}
    if args.validate:  # evaluation loads only the weights of a checkpoint directory
        out["val_epochs"] = list(recorder.val_losses)  # before validate() adds one
        out["val_ckpt"] = trainer.validate(model, val, args.validate)[0]["val_loss"]
    if trainer.is_global_zero:
        args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
