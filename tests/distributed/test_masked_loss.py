"""A masked loss over packed rows under dp, tp, pp and gradient accumulation, against one
plain-PyTorch process on the same global batch.

The reference takes each step's mean over every scored target of the global batch (rows
whose target counts differ a lot), SGD (whose update is proportional to the gradient, so a
wrong weighting shows, where Adam's normalization would hide a uniform scale). One spawn of
four ranks runs every layout through Lightning and ``HybridParallelStrategy``, packed rows
included (their positions reach every pipeline stage).
"""

from __future__ import annotations

import dataclasses
import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _dtensors import full_params
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import HybridParallelStrategy

from _harness import run_distributed

WORLD = 4
SEQ = 16
STEPS = 2
ROWS_PER_STEP = 8  # dp x per-rank batch x accumulation in every layout
LR = 0.5

LAYOUTS = {  # name: (strategy options, per-rank batch, accumulate_grad_batches)
    "dp2xtp2_accumulate2": (dict(data_parallel=2, tensor_parallel=2), 2, 2),
    "pp2xdp2_1f1b_accumulate2": (
        dict(data_parallel=2, pipeline_parallel=2, schedule="1f1b", microbatches=2),
        2,
        2,
    ),
    "dp4_zero2": (dict(data_parallel=4, zero_stage=2), 2, 1),
}


def _config() -> TransformerConfig:
    return dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=2, block_size=SEQ
    )


def _rows() -> TensorDataset:
    """Packed rows (two or three examples each) whose scored targets range from 1 to 13."""
    generator = torch.Generator().manual_seed(7)
    rows = STEPS * ROWS_PER_STEP
    vocab = _config().vocab_size
    x = torch.randint(vocab, (rows, SEQ), generator=generator)
    y = torch.randint(vocab, (rows, SEQ), generator=generator)
    positions = torch.empty(rows, SEQ, dtype=torch.long)
    for row in range(rows):
        cut = 3 + row % 7  # the second example starts here
        positions[row] = torch.cat((torch.arange(cut), torch.arange(SEQ - cut)))
        scored = 1 + (row * 5) % 13
        y[row, scored:] = -100
    return TensorDataset(x, y, positions)


def _dp_rank(rank: int, options: dict) -> int:
    """The data-parallel rank of global ``rank`` on the ``("pp", "dp", "tp")`` mesh."""
    return rank // options.get("tensor_parallel", 1) % options["data_parallel"]


class _Rows(L.LightningDataModule):
    loss_mask = True  # what ChatDataModule declares

    def __init__(self, batch_size: int, dp: int, dp_rank: int) -> None:
        super().__init__()
        self.batch_size, self.dp, self.dp_rank = batch_size, dp, dp_rank

    def train_dataloader(self) -> DataLoader:
        rows = _rows()
        sampler = DistributedSampler(rows, self.dp, self.dp_rank, shuffle=False)
        return DataLoader(rows, batch_size=self.batch_size, sampler=sampler)


def _fit(layout: str, rank: int) -> dict[str, Tensor]:
    options, batch_size, accumulate = LAYOUTS[layout]
    L.seed_everything(0, verbose=False)
    sgd = functools.partial(torch.optim.SGD, lr=LR)
    module = CausalLM(_config(), sgd, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(**options),
        plugins=[FP32Precision()], max_steps=STEPS, accumulate_grad_batches=accumulate,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = _Rows(batch_size, options["data_parallel"], _dp_rank(rank, options))
    trainer.fit(module, datamodule=data)
    return full_params(module)


def _layouts(rank: int, world_size: int) -> dict[str, dict[str, Tensor]]:
    return {layout: _fit(layout, rank) for layout in LAYOUTS}


def _reference(mean_of_means: bool = False) -> dict[str, Tensor]:
    """Plain PyTorch: each step's rows at once, the loss their scored targets' mean (or,
    as a control, the mean of per-row-pair means)."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(_config())
    module.configure_model()
    model: Transformer = module.model
    x, y, positions = _rows().tensors
    for step in range(STEPS):
        rows = slice(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
        logits = model(x[rows], positions=positions[rows])
        if mean_of_means:
            pairs = [
                F.cross_entropy(logits[i : i + 2].flatten(0, 1), y[rows][i : i + 2].flatten())
                for i in range(0, ROWS_PER_STEP, 2)
            ]
            loss = torch.stack(pairs).mean()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), y[rows].flatten())  # ignore_index -100
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad
    # state_dict, not named_parameters: the last pipeline stage holds the tied head by name
    return {f"model.{name}": p.detach().clone() for name, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Tensor]]]:
    return run_distributed(_layouts, WORLD)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_loss_equals_one_process_over_the_global_batch(runs: list, layout: str) -> None:
    expected = _reference()
    control = _reference(mean_of_means=True)
    apart = 0.0
    for rank_results in runs:
        params = rank_results[layout]
        assert params, f"rank holds no parameters under {layout}"
        for name, param in params.items():
            torch.testing.assert_close(param, expected[name], rtol=1e-4, atol=1e-5, msg=name)
            apart = max(apart, (expected[name] - control[name]).abs().max().item())
    assert apart > 1e-3  # a mean of means would have been caught
