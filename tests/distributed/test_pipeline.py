"""Pipeline parallelism (GPipe, 1F1B, interleaved) through Lightning, against one process.

Each case fits a CausalLM for a few steps with ``PipelineStrategy`` or the 4-D
``HybridParallelStrategy`` and compares with one process fitting the same weights on the
same global batches: the loss of every step (broadcast from the last stage to all ranks)
and, on every rank, the final value of every parameter it holds (gradient clipping on,
so the global norm must count each parameter once across stages, including GPT-2's
embedding tied to the head on the first and last stage). Processes start once per world
size (2, 4 and 8) and run all of that size's cases. What each rank holds in memory
during a step is measured in bytes in ``test_memory.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import (
    BF16MixedPrecision,
    BF16TruePrecision,
    FP16MixedPrecision,
    FP32Precision,
)
from plugintrain.strategies import (
    HybridParallelStrategy,
    PipelineExecutor,
    PipelineStrategy,
)
from plugintrain.strategies.pipeline_stages import split_model

from _harness import run_distributed
from _toy import ToyModel, ToyShape

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
    accumulate: int = 1
    layers: tuple[int, ...] | None = None
    kv_heads: int = 2

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        layout = f"dp{self.dp}-tp{self.tp}-pp{self.pp}-vpp{self.vpp}"
        accumulate = f"-acc{self.accumulate}" if self.accumulate > 1 else ""
        accumulate += f"-layers{'-'.join(map(str, self.layers))}" if self.layers else ""
        accumulate += f"-kv{self.kv_heads}" if self.kv_heads != 2 else ""
        return (
            f"{self.preset}-{layout}-{self.schedule}-m{self.microbatches}{accumulate}"
            f"-{self.precision}"
        )


def _cases() -> list[Case]:
    cases = []
    for precision in ("32-true", "bf16-mixed"):
        for pp in (2, 4):
            cases += [Case("gpipe", pp, precision=precision), Case("1f1b", pp, precision=precision)]
            cases.append(Case("interleaved", pp, vpp=2, precision=precision))
    # dp2 x tp2 x pp2 with ZeRO-1 (8 ranks, the costliest layout here): in fp32 it is
    # SAVED_4D below (4 kv heads); under bf16 with Llama's 2 kv heads, GQA split over tp.
    # (fp32 with 2 kv heads in this layout: tests/e2e/test_pipeline_launch.py's 4-D recipe.)
    cases.append(
        Case("1f1b", 2, dp=2, tp=2, preset="llama3-debug", precision="bf16-mixed", zero_stage=1)
    )
    # Data parallelism beside the pipeline with ZeRO-2.
    cases.append(Case("interleaved", 2, vpp=2, dp=2, zero_stage=2, microbatches=2))
    # Uneven stages: the last also runs the head, so it gets fewer layers.
    cases.append(Case("1f1b", 2, layers=(5, 3)))
    # Lightning's gradient accumulation around the schedule's own micro-batches.
    cases.append(Case("1f1b", 2, microbatches=2, accumulate=2))
    # FP16 loss scaling on the last stage; overflowing steps skipped on every stage.
    cases.append(Case("1f1b", 2, precision="16-mixed", preset="llama3-debug"))
    # bf16 weights: the second stage takes its (bf16 wire) input as bf16 (it used to get
    # fp32 activations into bf16 weights: "mat1 and mat2 must have the same dtype").
    cases.append(Case("1f1b", 2, precision="bf16-true", preset="llama3-debug"))
    cases.append(SAVED_4D)
    return cases


# dp2 x tp2 x pp2 with ZeRO-1, checkpointed after its run and resumed under other layouts;
# four kv heads so that tp = 4 can resume it.
SAVED_4D = Case("1f1b", 2, dp=2, tp=2, preset="llama3-debug", zero_stage=1, kv_heads=4)
CASES = _cases()


def _config(preset: str, kv_heads: int = 2) -> TransformerConfig:
    return TransformerConfig.from_name(
        preset, n_layer=N_LAYER, vocab_size=VOCAB, n_embd=32, block_size=SEQ, n_kv_head=kv_heads
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
    if name == "16-mixed":
        # A scale that overflows fp16 in the first steps: every stage must skip them.
        return FP16MixedPrecision(init_scale=2.0**24)
    if name == "bf16-true":
        return BF16TruePrecision()
    return FP32Precision() if name == "32-true" else BF16MixedPrecision()


def _fit(
    case: Case,
    strategy: Any = "auto",
    dp_rank: int = 0,
    accumulate: int = 1,
    steps: int = STEPS,
    save: Path | None = None,
    resume: Path | None = None,
    callbacks: tuple[Callback, ...] = (),
    validate: bool = False,
) -> dict[str, Any]:
    """Fit for ``steps`` steps of GLOBAL_BATCH sequences; losses and this rank's weights.

    With ``accumulate > 1`` each optimizer step accumulates that many equal
    micro-batches, and the step's loss is their mean. ``save`` writes a checkpoint at the
    end, ``resume`` continues from one; ``validate`` runs the validation loop on the
    first GLOBAL_BATCH sequences after each epoch (STEPS steps).
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
    config = _config(case.preset, case.kv_heads)
    module = CausalLM(config, optimizer, warmup_steps=0, min_lr_ratio=1.0)
    data = _batches()
    dp = 1 if strategy == "auto" else case.dp
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    losses = _Losses()
    precision = _precision(case.precision)
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else case.world, strategy=strategy,
        plugins=[precision], max_steps=steps, gradient_clip_val=0.5,
        use_distributed_sampler=False, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses, *callbacks],
        accumulate_grad_batches=accumulate, limit_val_batches=None if validate else 0,
    )  # fmt: skip
    batch = GLOBAL_BATCH // dp // accumulate
    val_data = TensorDataset(*(t[:GLOBAL_BATCH] for t in data.tensors))
    val_sampler = DistributedSampler(val_data, num_replicas=dp, rank=dp_rank, shuffle=False)
    trainer.fit(
        module,
        DataLoader(data, batch_size=batch, sampler=sampler),
        DataLoader(val_data, batch_size=GLOBAL_BATCH // dp, sampler=val_sampler),
        ckpt_path=resume,
    )
    if save is not None:
        trainer.save_checkpoint(save)
    # Lightning reports each micro-batch loss divided by `accumulate`.
    step_losses = torch.tensor(losses.losses).view(-1, accumulate).sum(1).tolist()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }
    scaler = getattr(precision, "loss_scaler", None)
    return {
        "losses": step_losses,
        "params": params,
        "val_loss": trainer.callback_metrics.get("val_loss"),
        "scale": scaler.scale if scaler is not None else None,
        "progress_bar": dict(trainer.progress_bar_metrics),
    }


def _strategy(case: Case) -> Any:
    if case.tp == 1:
        return PipelineStrategy(
            pipeline_parallel=case.pp,
            virtual_pipeline_parallel=case.vpp,
            schedule=case.schedule,
            microbatches=case.microbatches,
            layers_per_stage=list(case.layers) if case.layers else None,
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


def _run_cases(rank: int, world_size: int, cases: list[Case], root: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for case in cases:
        dp_rank = (rank // case.tp) % case.dp  # mesh (pp, dp, tp), tp innermost
        # Resumed runs match uninterrupted ones when both validate at the epoch's end (as
        # ModelCheckpoint users' runs do); see test_checkpoint_resumes_under_another_layout.
        saving = case == SAVED_4D
        save = Path(root) / "saved_4d" if saving else None
        results[case] = _fit(
            case, _strategy(case), dp_rank, case.accumulate, save=save, validate=saving
        )
    return results


@pytest.fixture(scope="module")
def checkpoints() -> Iterator[Path]:
    """A directory for the checkpoints the module's runs write and resume."""
    with tempfile.TemporaryDirectory() as root:
        yield Path(root)


@pytest.fixture(scope="module")
def runs(checkpoints: Path) -> dict[int, list[dict[Case, dict]]]:
    by_world: dict[int, list[Case]] = {}
    for case in CASES:
        by_world.setdefault(case.world, []).append(case)
    return {
        world: run_distributed(_run_cases, world, cases, str(checkpoints), timeout=900)
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
    single = dataclasses.replace(case, dp=1, tp=1, pp=1, accumulate=1)
    accumulate = case.microbatches * case.dp * case.accumulate
    accumulate = accumulate if case.precision != "32-true" else 1
    return _fit(single, accumulate=accumulate)


# GPT-2's head is its embedding: one parameter in one process, a copy on the last stage.
_TIED = {"model.output.weight": "model.tok_embeddings.weight"}


TOL = {"rtol": 1e-4, "atol": 1e-5}


def _tolerance(case: Case) -> dict[str, float]:
    if case.precision == "bf16-true":
        # Losses agree to TOL. The weights are bf16, so the last-bit differences of their
        # gradients (the tied embedding's two copies summed after, not during, each
        # micro-batch; the clipping norm summed per stage) move an SGD update across a
        # rounding boundary here and there: one ulp of the tensor's largest values.
        return {"rtol": 2**-7, "atol": 1e-3}
    if case.precision != "32-true":
        # Low-precision matmuls round their fp32 accumulations to bf16/fp16, and where that
        # accumulation splits (tp's partial products, the CPU kernel's threads: one per rank
        # here, more in the reference process) the roundings differ: a bias that sums a
        # micro-batch's gradients then differs by ~2e-5 after three steps. bf16-level.
        return {"rtol": 1e-3, "atol": 1e-4}
    return {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_single_process(runs: dict[int, list[dict[Case, dict]]], case: Case) -> None:
    reference = _reference(case)
    seen: set[str] = set()
    for rank_results in runs[case.world]:
        got = rank_results[case]
        losses = TOL if case.precision == "bf16-true" else _tolerance(case)
        torch.testing.assert_close(got["losses"], reference["losses"], **losses)
        assert got["params"], "every rank holds some parameters"
        for name, param in got["params"].items():
            torch.testing.assert_close(
                param, reference["params"][_TIED.get(name, name)], **_tolerance(case), msg=name
            )
        seen |= {_TIED.get(name, name) for name in got["params"]}
    assert seen == set(reference["params"]), "the stages together hold the whole model"
    if case.precision == "16-mixed":
        assert reference["scale"] < 2.0**24, "the case must overflow at least once"
        for rank_results in runs[case.world]:
            assert rank_results[case]["scale"] == reference["scale"]


# ---- checkpoints under another layout, callbacks, validation -------------------------------

RESUME = Case("1f1b", 2, dp=2, zero_stage=1)


def _resume_runs(rank: int, world_size: int, root: str, saved_root: str) -> dict[str, dict]:
    """Save after one epoch under one layout, resume for another epoch under others."""
    tmp = Path(root)
    pp2 = PipelineStrategy(pipeline_parallel=2, microbatches=4, zero_stage=1)
    dp4 = HybridParallelStrategy(zero_stage=2)  # no pipeline: dp=4
    pp4_resumes = {
        "from_pp2": PipelineStrategy(pipeline_parallel=4, microbatches=4, schedule="gpipe"),
        "from_dp4": PipelineStrategy(pipeline_parallel=4, virtual_pipeline_parallel=2),
    }
    results = {}
    results["pp2"] = _fit(RESUME, pp2, dp_rank=rank % 2, save=tmp / "pp2")
    results["dp4"] = _fit(dataclasses.replace(RESUME, dp=4, pp=1), dp4, rank, save=tmp / "dp4")
    for name, strategy in pp4_resumes.items():
        source = tmp / name.removeprefix("from_")
        best = ModelCheckpoint(
            dirpath=tmp / f"best_{name}",
            monitor="train_loss",
            save_top_k=1,
            every_n_train_steps=1,
        )
        # Not strict: the checkpoint was written after the last step of the first epoch, so
        # the resumed run first closes that (empty) epoch, with no train_loss logged yet.
        stop = EarlyStopping(
            monitor="train_loss", patience=100, check_on_train_epoch_end=True, strict=False
        )
        results[name] = _fit(
            dataclasses.replace(RESUME, dp=1, pp=4),
            strategy,
            steps=2 * STEPS,
            resume=source,
            callbacks=(best, stop),
            validate=True,
        )
        results[name]["best_score"] = best.best_model_score.item()
        results[name]["best_path"] = best.best_model_path
        results[name]["stop_best"] = stop.best_score.item()
    # A dp4 run resumed from the pipeline's checkpoint: the head is tied to the embedding,
    # one parameter here and two on the pipeline's first and last stage.
    results["dp4_from_pp2"] = _fit(
        dataclasses.replace(RESUME, dp=4, pp=1),
        HybridParallelStrategy(zero_stage=0),
        rank,
        steps=2 * STEPS,
        resume=tmp / "pp2",
        validate=True,
    )
    # The dp2 x tp2 x pp2 ZeRO-1 checkpoint under tp = 4, and under dp = 4 with ZeRO-2.
    saved = Path(saved_root) / "saved_4d"
    tp4 = HybridParallelStrategy(tensor_parallel=4, sequence_parallel=True, zero_stage=1)
    results["tp4_from_4d"] = _fit(
        dataclasses.replace(_ALONE_4D, tp=4), tp4, steps=2 * STEPS, resume=saved, validate=True
    )
    results["dp4_from_4d"] = _fit(
        dataclasses.replace(_ALONE_4D, dp=4),
        HybridParallelStrategy(zero_stage=2),
        rank,
        steps=2 * STEPS,
        resume=saved,
        validate=True,
    )
    return results


_ALONE_4D = dataclasses.replace(SAVED_4D, dp=1, tp=1, pp=1)


def _resume_alone(rank: int, world_size: int, saved_root: str) -> dict[str, Any]:
    """The dp2 x tp2 x pp2 checkpoint resumed by one process (a world of one)."""
    saved = Path(saved_root) / "saved_4d"
    return _fit(_ALONE_4D, HybridParallelStrategy(), steps=2 * STEPS, resume=saved, validate=True)


@pytest.fixture(scope="module")
def resumed(runs: dict, checkpoints: Path) -> list[dict[str, dict]]:
    with tempfile.TemporaryDirectory() as root:
        resumes = run_distributed(_resume_runs, 4, root, str(checkpoints), timeout=900)
    alone = run_distributed(_resume_alone, 1, str(checkpoints), timeout=300)[0]
    return [{**rank_results, "one_from_4d": alone} for rank_results in resumes]


@pytest.mark.parametrize("run", ["from_pp2", "from_dp4", "dp4_from_pp2"])
def test_checkpoint_resumes_under_another_layout(resumed: list[dict], run: str) -> None:
    """Weights and AdamW state (ZeRO-1 sharded on save) reload by full-model names."""
    reference = _fit(RESUME.__class__(RESUME.schedule, 1), steps=2 * STEPS, validate=True)
    seen: set[str] = set()
    for rank_results in resumed:
        got = rank_results[run]
        # Only the resumed epoch's steps are recorded by the resumed run.
        torch.testing.assert_close(got["losses"], reference["losses"][STEPS:], **TOL)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, reference["params"][_TIED.get(name, name)], **TOL)
            seen.add(_TIED.get(name, name))
        # Validation ran as a forward-only schedule and logged the single process's loss.
        torch.testing.assert_close(got["val_loss"], reference["val_loss"], **TOL)
    assert seen == set(reference["params"])


@pytest.mark.parametrize("run", ["tp4_from_4d", "dp4_from_4d", "one_from_4d"])
def test_sharded_4d_checkpoint_resumes_under_tp_dp_and_one_process(
    resumed: list[dict], run: str
) -> None:
    """Each rank of dp2 x tp2 x pp2 saved only its ZeRO-1 slice of its tp shard of its
    stage's AdamW state; tp4, dp4 and one process read their own slices of that and
    continue as the uninterrupted single process does."""
    reference = _fit(_ALONE_4D, steps=2 * STEPS, validate=True)
    # The saved weights differ from one process's in the last bits (tp's row-parallel sums
    # run in another order); three more AdamW steps turn that into ~1e-5 where a gradient
    # is near zero (see `_fit`), so weights are compared at 1e-4.
    weights = {"rtol": 1e-4, "atol": 1e-4}
    for rank_results in resumed:
        got = rank_results[run]
        torch.testing.assert_close(got["losses"], reference["losses"][STEPS:], **TOL)
        assert set(got["params"]) == set(reference["params"])
        for name, param in got["params"].items():
            torch.testing.assert_close(param, reference["params"][name], **weights, msg=name)


def test_loss_reading_callbacks_work(resumed: list[dict]) -> None:
    """ModelCheckpoint and EarlyStopping monitor train_loss; the progress bar shows it."""
    for rank_results in resumed:
        got = rank_results["from_pp2"]
        best = min(got["losses"])
        assert got["best_score"] == pytest.approx(best, rel=1e-6)
        # Checked at the end of the (resumed) epoch: its last step's loss.
        assert got["stop_best"] == pytest.approx(got["losses"][-1], rel=1e-6)
        assert Path(got["best_path"]).name.endswith(f"-step={_best_step(got)}.ckpt")
        assert got["progress_bar"]["train_loss"] == pytest.approx(got["losses"][-1], rel=1e-6)


def _best_step(got: dict) -> int:
    return STEPS + 1 + got["losses"].index(min(got["losses"]))


# ---- the data-parallel reduction overlaps the pipeline's cool-down --------------------------

# pp2 x dp2 with GPT-2 (its head tied to the embedding), one and two chunks per rank.
OVERLAP_CASES = [
    Case("1f1b", 2, dp=2, zero_stage=1),
    Case("interleaved", 2, vpp=2, dp=2, zero_stage=1),
]


class _StepLog(Callback):
    """Per step: the executor's events, and when the gradient engine started each bucket's
    collective (its own launch, wrapped), with the bucket's parameter names."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.launches: list[tuple[float, list[str]]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        reductions = trainer.strategy._binding.engine._reductions
        launch = reductions.launch

        def timed(bucket: Any) -> None:
            self.launches.append((time.perf_counter(), [e.name for e in bucket.entries]))
            launch(bucket)

        reductions.launch = timed

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        executor = trainer.strategy._pipeline.executor
        self.steps.append(
            {
                "events": [tuple(event) for event in executor.events],
                "launches": self.launches,
                "seconds": (executor.wait_seconds, executor.step_seconds),
            }
        )
        self.launches = []


def _overlap_cases(rank: int, world_size: int) -> dict[Case, dict[str, Any]]:
    results = {}
    for case in OVERLAP_CASES:
        log = _StepLog()
        got = _fit(case, _strategy(case), dp_rank=rank % case.dp, callbacks=(log,))
        results[case] = {**got, "steps": log.steps}
    return results


@pytest.fixture(scope="module")
def overlap_runs() -> list[dict[Case, dict[str, Any]]]:
    return run_distributed(_overlap_cases, 4, timeout=600)


def _tied(names: list[str]) -> bool:
    return any(name in _TIED or name in _TIED.values() for name in names)


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=str)
def test_dp_reduction_starts_during_the_cool_down(
    overlap_runs: list[dict[Case, dict[str, Any]]], case: Case
) -> None:
    """Each chunk's buckets start their dp reduction right after its last backward of the
    step (an ``R`` event), before the step's last backward runs (on the same rank with two
    chunks, on the other pipeline rank with one); the tied embedding and head wait for
    their two copies to be summed after the schedule. Losses and weights stay those of
    one process."""
    reference = _reference(case)
    for rank_results in overlap_runs:
        torch.testing.assert_close(rank_results[case]["losses"], reference["losses"], **TOL)
        for name, param in rank_results[case]["params"].items():
            torch.testing.assert_close(param, reference["params"][_TIED.get(name, name)], **TOL)
    for step in range(STEPS):
        steps = [rank_results[case]["steps"][step] for rank_results in overlap_runs]
        last_backward = [max(t for kind, *_, t in s["events"] if kind == "B") for s in steps]
        first_launch = []
        for rank, s in enumerate(steps):
            handed = sorted(chunk for kind, chunk, *_ in s["events"] if kind == "R")
            assert handed == list(range(case.vpp))
            for t, names in s["launches"]:
                assert not _tied(names) or t > last_backward[rank], names
            first_launch.append(min(t for t, names in s["launches"] if not _tied(names)))
            wait, seconds = s["seconds"]
            assert 0.0 <= wait <= seconds
        if case.vpp > 1:  # the later chunk's reduction starts before the earlier's backward
            assert all(f < b for f, b in zip(first_launch, last_backward, strict=True))
        else:  # the last stage's (ranks 2, 3: mesh (pp, dp)) before its partner's on stage 0
            assert first_launch[2] < last_backward[0] and first_launch[3] < last_backward[1]


# ---- the executor's batched point-to-point transfers, against one process ---------------------

# (schedule, vpp, groups of pp micro-batches, evaluation micro-batches): interleaved
# training over more than one group posts some receives an action early, and evaluation
# with vpp > 1 over at least 2 x pp micro-batches receives the last rank's outputs early.
EXECUTOR_LAYOUTS = [
    ("gpipe", 1, 1, 3),
    ("1f1b", 1, 2, 5),
    ("interleaved", 2, 2, 9),
    ("interleaved", 3, 3, 11),
]


def _toy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _toy_step(pp: int, rank: int, group: Any, layout: tuple) -> dict[str, Any]:
    """One training step and one evaluation of ``layout`` on pipeline rank ``rank``."""
    name, vpp, groups, m_eval = layout
    m = groups * pp
    torch.manual_seed(0)
    shape = ToyShape(n_layer=pp * vpp)
    model = ToyModel(shape)
    stages = split_model(model, rank, pp, vpp)
    executor = PipelineExecutor(stages, name, pp, vpp, m, rank, group, _toy_loss, shape.n_embd)
    tokens = torch.randint(0, shape.vocab_size, (max(m, m_eval), SEQ + 1))
    inputs, targets = list(tokens[:, None, :-1]), list(tokens[:, None, 1:])  # (1, SEQ) each
    train = executor.train_step(inputs[:m], targets[:m], loss_scale=1 / m)
    evaluation = executor.eval_step(inputs[:m_eval], targets[:m_eval])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"train": train, "eval": evaluation, "grads": grads, "tokens": tokens}


def _toy_runs(rank: int, world_size: int) -> dict[tuple, dict[str, Any]]:
    """pp = 4 on the world of 4, and pp = 2 on ranks (0, 1) and on (2, 3) at once."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for pp, group, pp_rank in ((4, None, rank), (2, pairs[rank // 2], rank % 2)):
        for layout in EXECUTOR_LAYOUTS:
            results[(pp, *layout)] = _toy_step(pp, pp_rank, group, layout)
    return results


@pytest.fixture(scope="module")
def toy_runs() -> list[dict[tuple, dict[str, Any]]]:
    return run_distributed(_toy_runs, 4, timeout=300)


def _toy_reference(pp: int, layout: tuple, tokens: torch.Tensor) -> dict[str, Any]:
    """One process: the whole toy model over the same micro-batches."""
    _, vpp, groups, m_eval = layout
    torch.manual_seed(0)
    model = ToyModel(ToyShape(n_layer=pp * vpp))
    losses = [_toy_loss(model(t[None, :-1]), t[None, 1:]) for t in tokens[: groups * pp]]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        evaluation = [_toy_loss(model(t[None, :-1]), t[None, 1:]) for t in tokens[:m_eval]]
    return {
        "train": torch.stack(losses).mean().detach(),
        "eval": torch.stack(evaluation).mean(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("layout", EXECUTOR_LAYOUTS, ids=lambda x: f"{x[0]}-vpp{x[1]}")
def test_executor_batched_transfers_match_one_process(
    toy_runs: list[dict[tuple, dict[str, Any]]], pp: int, layout: tuple
) -> None:
    """Every transfer goes through ``batch_isend_irecv`` in the batches of ``p2p_plan``
    (each send with the receive needed next, some receives early): the training and
    evaluation losses and every stage's gradients equal one process's."""
    reference = _toy_reference(pp, layout, toy_runs[0][(pp, *layout)]["tokens"])
    for rank, rank_results in enumerate(toy_runs):
        got = rank_results[(pp, *layout)]
        if rank % pp == pp - 1:  # the last stage computes the losses
            torch.testing.assert_close(got["train"], reference["train"], **TOL)
            torch.testing.assert_close(got["eval"], reference["eval"], **TOL)
        else:
            assert got["train"] is None and got["eval"] is None
        assert got["grads"], "every rank holds some parameters"
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], **TOL, msg=name)
