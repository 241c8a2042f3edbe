"""The scaling calculator's collectives against real ranks, under mixed precision.

A dry run's traced step runs on meta tensors, where autocast does not run (torch has no
autocast for the meta device), so under ``bf16-mixed`` its collectives carry fp32; the
unit tests compare the calculator's step from the shapes with traced steps in fp32
(``tests/unit/test_timing.py``). Here two real gloo ranks train one step under
``bf16-mixed`` with CPU autocast, as a GPU run autocasts, and the dry run's recorder counts
every collective they issue between the batch's start and its end (forward, backward,
the gradient engine's reductions, the optimizer step and its parameter gather): the bytes
of each kind on each mesh dimension must equal the calculator's
(:func:`~plugintrain.estimate.timing.formula_costs`): fp32 where the residual stream,
the norms' outputs and the gradients flowing back into them travel, bf16 where the
matmuls' outputs and their gradients do, bf16 between pipeline stages.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.estimate import Layout
from plugintrain.estimate.dry_run import TrafficRecorder
from plugintrain.estimate.timing import formula_costs
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import BF16MixedPrecision
from plugintrain.strategies import HybridParallelStrategy

from _harness import run_distributed

SEQ, BATCH = 32, 2
CONFIG = TransformerConfig.from_name(
    "llama3-debug", n_embd=128, n_head=4, n_kv_head=2, vocab_size=256, n_layer=2, block_size=SEQ
)
LAYOUTS = {
    "tp2 (sp)": dict(tp=2, sp=True),
    "tp2": dict(tp=2),
    "tp2 (sp), full recomputation": dict(tp=2, sp=True, recompute="full"),
    "pp2": dict(pp=2, microbatches=2),
    "dp2, zero2": dict(dp=2, zero_stage=2),
    "dp2 x ep2, zero1 (experts)": dict(dp=2, ep=2, zero_stage=1),
    # Context parallelism: the K/V exchange (all-gather forward, reduce-scatter backward,
    # bf16 under autocast) on cp; gradients all-reduced over dp x cp (here: the cp group).
    "cp2": dict(cp=2),
    "cp2, full recomputation": dict(cp=2, recompute="full"),
}
MOE = TransformerConfig.from_name("deepseek-v3-debug", block_size=SEQ)


def _config(name: str) -> TransformerConfig:
    return MOE if "experts" in name else CONFIG


def _layout(degrees: dict) -> Layout:
    return Layout.of("hybrid", precision="bf16-mixed", micro_batch=BATCH, seq_len=SEQ, **degrees)


class _Recorded(L.Callback):
    """Every collective of the first training batch, from its start to its end."""

    def __init__(self) -> None:
        self.recorder: TrafficRecorder | None = None
        self.traffic: dict[tuple[str, str], int] = {}
        self.sent = 0

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.recorder = TrafficRecorder(trainer.strategy.device_mesh, trainer.global_rank)
        self.recorder.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        assert self.recorder is not None
        self.recorder.__exit__(None, None, None)
        # A group of one rank (dp = 1) moves nothing; sends are the pipeline's.
        summary = self.recorder.summary()
        self.traffic = {(t.op, t.dim): t.bytes for t in summary
                        if t.group_size > 1 and t.op not in ("send", "recv")}  # fmt: skip
        self.sent = sum(t.bytes for t in summary if t.op == "send")


def _one_step(name: str, rank: int) -> tuple[dict[tuple[str, str], int], int]:
    layout, config = _layout(LAYOUTS[name]), _config(name)
    dims = layout.dims
    L.seed_everything(0, verbose=False)
    probe = _Recorded()
    strategy = HybridParallelStrategy(
        data_parallel=dims.dp, tensor_parallel=dims.tp, sequence_parallel=dims.sequence_parallel,
        pipeline_parallel=dims.pp, microbatches=layout.pipeline.microbatches,
        expert_parallel=dims.ep, context_parallel=dims.cp,
        zero_stage=dims.zero_stage, activation_checkpointing=layout.blocks.activation_checkpointing,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[BF16MixedPrecision()],
        max_steps=1, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    rows = BATCH * (layout.pipeline.microbatches if dims.pp > 1 else 1)
    tokens = torch.randint(0, config.vocab_size, (rows, SEQ + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer.fit(CausalLM(config), DataLoader(data, batch_size=rows))
    return probe.traffic, probe.sent


def _all_layouts(rank: int, world_size: int) -> dict[str, dict]:
    return {name: _one_step(name, rank) for name in LAYOUTS}


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, dict]]:
    return run_distributed(_all_layouts, 2, timeout=600)


def _named(measured: dict, layout: Layout) -> dict:
    """Traffic by the calculator's dimension names: with dp = ep the recorder names the one
    group ``ep``; the gradient reduction over it is the calculator's ``dp``. With cp and dp
    1 the dp x cp group is the cp group: its all-reduce (the gradients') is ``dp``."""
    if layout.dims.cp > 1 and layout.dims.dp == 1:
        return {(op, "dp" if op == "all_reduce" else dim): n for (op, dim), n in measured.items()}
    if layout.dims.ep == 1 or layout.dims.ep != layout.dims.dp:
        return measured
    return {(op, "dp" if op != "all_to_all" else dim): n for (op, dim), n in measured.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collective_bytes_equal_the_calculators(recorded: list, name: str) -> None:
    layout = _layout(LAYOUTS[name])
    costs = formula_costs(_config(name), layout)
    rows = BATCH * SEQ * (layout.pipeline.microbatches if layout.dims.pp > 1 else 1)
    routed = 0
    for rank, by_rank in enumerate(recorded):
        measured, sent = by_rank[name]
        measured = _named(measured, layout)
        pp_rank = rank // (layout.dims.dp * layout.dims.cp * layout.dims.tp)
        predicted = {(c.op, c.dim): c.bytes for c in costs[pp_rank].collectives}
        total = sum(measured.values())
        weighty = {k: v for k, v in measured.items() if v >= 0.05 * total}
        assert weighty, measured
        for key, nbytes in weighty.items():
            assert key in predicted, (rank, key, measured)
            if key[0] == "all_to_all":  # the routing decides each rank's share: summed below
                routed += nbytes - predicted[key]
                continue
            # Beside the bytes of each kind, the vocabulary-parallel loss's per-token
            # scalars (a few fp32 values a token; the calculator counts 3) may differ.
            assert abs(predicted[key] - nbytes) <= max(0.01 * nbytes, 64 * rows), (rank, key)
        assert costs[pp_rank].p2p_bytes == sent
    # Over all ranks, every token's top-k copies go out and come back: what the ranks sent
    # in all equals the calculator's, up to the expert counts exchanged first (64 bytes a call).
    assert abs(routed) <= 0.05 * sum(v for r in recorded for (op, _), v in r[name][0].items()
                                     if op == "all_to_all")  # fmt: skip


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("cp")])
def test_the_kv_exchange_bytes_equal_the_calculators(recorded: list, name: str) -> None:
    """The K/V exchange is small beside the gradients at these sizes: checked on its own,
    to the byte, on every rank (forward all-gathers, backward reduce-scatters, a rerun's
    all-gathers), and the bytes written out: a block's keys and values of whole rows,
    2 rows x 32 tokens x 2 heads x 32 channels x 2 (K, V) in bf16."""
    layout = _layout(LAYOUTS[name])
    (cost,) = formula_costs(_config(name), layout)
    predicted = {(c.op, c.dim): c.bytes for c in cost.collectives if c.dim == "cp"}
    blocks, one = CONFIG.n_layer, BATCH * SEQ * 2 * 32 * 2 * 2
    gathers = 2 if "recomputation" in name else 1
    assert predicted == {
        ("all_gather", "cp"): gathers * blocks * one,
        ("reduce_scatter", "cp"): blocks * one,
    }
    for measured, _ in (by_rank[name] for by_rank in recorded):
        assert {k: v for k, v in measured.items() if k[1] == "cp" and k[0] != "all_reduce"} == (
            predicted
        )
