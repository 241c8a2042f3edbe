"""Pipeline parallelism (GPipe, 1F1B, interleaved) through Lightning, against one process.

Each case fits a CausalLM for a few steps with ``PipelineStrategy`` or the 4-D
``HybridParallelStrategy`` and compares with one process fitting the same weights on the
same global batches: the loss of every step (broadcast from the last stage to all ranks)
and, on every rank, the final value of every parameter it holds (gradient clipping on,
so the global norm must count each parameter once across stages, including GPT-2's
embedding tied to the head on the first and last stage). Processes start once per world
size (2, 4 and 8) and run all of that size's cases.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import BF16MixedPrecision, FP32Precision
from plugintrain.strategies import HybridParallelStrategy, PipelineStrategy

from _harness import run_distributed

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
N_LAYER = 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout: world = dp x tp x pp ranks."""

    schedule: str
    pp: int
    vpp: int = 1
    dp: int = 1
    tp: int = 1
    microbatches: int = 4
    precision: str = "32-true"
    preset: str = "gpt2-debug"
    zero_stage: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        layout = f"dp{self.dp}-tp{self.tp}-pp{self.pp}-vpp{self.vpp}"
        return f"{self.preset}-{layout}-{self.schedule}-m{self.microbatches}-{self.precision}"


def _cases() -> list[Case]:
    cases = []
    for precision in ("32-true", "bf16-mixed"):
        for pp in (2, 4):
            cases += [Case("gpipe", pp, precision=precision), Case("1f1b", pp, precision=precision)]
            cases.append(Case("interleaved", pp, vpp=2, precision=precision))
        cases.append(
            Case("1f1b", 2, dp=2, tp=2, preset="llama3-debug", precision=precision, zero_stage=1)
        )
    # Data parallelism beside the pipeline with ZeRO-2, and a tied head with 4 stages.
    cases.append(Case("interleaved", 2, vpp=2, dp=2, zero_stage=2, microbatches=2))
    return cases


CASES = _cases()


def _config(preset: str) -> TransformerConfig:
    return TransformerConfig.from_name(
        preset, n_layer=N_LAYER, vocab_size=VOCAB, n_embd=32, block_size=SEQ, n_kv_head=2
    )


def _batches() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=gen)
    return TensorDataset(data[:, :-1], data[:, 1:])


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        # Every rank holds its replica's loss; the world mean is the global batch's.
        self.losses.append(
            trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        )


def _precision(name: str) -> Any:
    return FP32Precision() if name == "32-true" else BF16MixedPrecision()


def _fit(
    case: Case, strategy: Any = "auto", dp_rank: int = 0, accumulate: int = 1
) -> dict[str, Any]:
    """Fit for STEPS steps of GLOBAL_BATCH sequences; losses and this rank's weights.

    With ``accumulate > 1`` (one process only) each step accumulates that many equal
    micro-batches, and the step's loss is their mean.
    """
    L.seed_everything(0, verbose=False)
    # Adam's normalized update turns last-bit differences (a norm summed over ranks in
    # another order) into full-size steps where a gradient is near zero; under bf16
    # autocast those differences then flip roundings of the cast weights. SGD keeps a
    # bf16 run's last-bit differences last-bit, so both precisions meet fp32 tolerances.
    if case.precision == "32-true":
        optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5)
    else:
        optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    module = CausalLM(_config(case.preset), optimizer, warmup_steps=0, min_lr_ratio=1.0)
    data = _batches()
    dp = 1 if strategy == "auto" else case.dp
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else case.world, strategy=strategy,
        plugins=[_precision(case.precision)], max_steps=STEPS, gradient_clip_val=0.5,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
        accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(
        module, DataLoader(data, batch_size=GLOBAL_BATCH // dp // accumulate, sampler=sampler)
    )
    # Lightning reports each micro-batch loss divided by `accumulate`.
    step_losses = torch.tensor(losses.losses).view(-1, accumulate).sum(1).tolist()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }
    return {"losses": step_losses, "params": params}


def _strategy(case: Case) -> Any:
    if case.tp == 1:
        return PipelineStrategy(
            pipeline_parallel=case.pp,
            virtual_pipeline_parallel=case.vpp,
            schedule=case.schedule,
            microbatches=case.microbatches,
            zero_stage=case.zero_stage,
        )
    return HybridParallelStrategy(
        tensor_parallel=case.tp,
        sequence_parallel=True,
        pipeline_parallel=case.pp,
        virtual_pipeline_parallel=case.vpp,
        schedule=case.schedule,
        microbatches=case.microbatches,
        zero_stage=case.zero_stage,
    )


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[Case, dict]:
    results = {}
    for case in cases:
        dp_rank = (rank // case.tp) % case.dp  # mesh (pp, dp, tp), tp innermost
        results[case] = _fit(case, _strategy(case), dp_rank)
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[Case, dict]]]:
    by_world: dict[int, list[Case]] = {}
    for case in CASES:
        by_world.setdefault(case.world, []).append(case)
    return {
        world: run_distributed(_run_cases, world, cases, timeout=900)
        for world, cases in sorted(by_world.items())
    }


@functools.cache
def _reference(case: Case) -> dict[str, Any]:
    """One process on the whole batch; under bf16 autocast, on the same micro-batches.

    In fp32 the pipeline must equal plain full-batch training. Under bf16-mixed each
    micro-batch's weight gradient is rounded to bf16 before it is accumulated in fp32,
    which differs from rounding one full-batch sum, so the reference accumulates the
    same micro-batches (``accumulate_grad_batches``) in one process.
    """
    single = dataclasses.replace(case, dp=1, tp=1, pp=1)
    accumulate = case.microbatches * case.dp if case.precision != "32-true" else 1
    return _fit(single, accumulate=accumulate)


# GPT-2's head is its embedding: one parameter in one process, a copy on the last stage.
_TIED = {"model.output.weight": "model.tok_embeddings.weight"}


def _tolerance(case: Case) -> dict[str, float]:
    if case.tp > 1 and case.precision != "32-true":
        # Row-parallel Linears round each rank's partial product to bf16 before the tp
        # all-reduce; one process rounds the whole sum once. The first loss already
        # differs by ~5e-6 relative: a bf16-level, not an fp32-level, difference.
        return {"rtol": 1e-3, "atol": 1e-4}
    return {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_single_process(runs: dict[int, list[dict[Case, dict]]], case: Case) -> None:
    reference = _reference(case)
    seen: set[str] = set()
    for rank_results in runs[case.world]:
        got = rank_results[case]
        torch.testing.assert_close(got["losses"], reference["losses"], **_tolerance(case))
        assert got["params"], "every rank holds some parameters"
        for name, param in got["params"].items():
            torch.testing.assert_close(
                param, reference["params"][_TIED.get(name, name)], **_tolerance(case), msg=name
            )
        seen |= {_TIED.get(name, name) for name in got["params"]}
    assert seen == set(reference["params"]), "the stages together hold the whole model"
