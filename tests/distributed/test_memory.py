"""Memory claims measured at the peak by a tracker that sees every tensor.

Processes start once per world size (2 and 4) and measure every mechanism.

**Gradients.**
Gradient memory of the engine's stages during backward, at world 2 and 4. The reference
is plain PyTorch on the same model with each gradient dropped as soon as autograd made
it (the compute-only peak: weights, activations, one parameter's gradient in flight);
what a stage adds on top of that is its gradient memory at the peak. ZeRO-2 must stay
within its 1/N shard plus two full buckets (the one being reduce-scattered and the one
filling), also under gradient accumulation (plus the one shard-sized reduce-scatter
output of a later pass). The tracker counts tensors that operators allocate, not the
communication backend's internal buffers (gloo stages a copy of a reduce-scatter's input
inside the backend; NCCL needs none). DDP and ZeRO-1 hold the whole gradient by design.

**Pipeline buffers.** What one pipeline rank holds during a step, beyond its weights and
gradients, against "one micro-batch's worth": the bytes that one micro-batch's forward
through one of the rank's virtual stages leaves alive (input, saved activations,
output), measured the same way without the executor. 1F1B's rank r may hold
min(pp - r, m) of them plus one, GPipe m plus one (and at least m - 1), interleaved its
simulated in-flight count plus one; and one boundary tensor more (a gradient whose send
is still on its way). The toy model's blocks save little, so the boundary tensors an
executor kept until the step's end (all m of them) would break these bounds.

**Sharded checkpoints.** A ZeRO-2 save and load each add at most one gradient bucket to a
rank's peak (what the load leaves, the rank's optimizer state, is not counted); gathering
the state to rank 0 (the single-file way) adds the other ranks' shards there.

**Shard-first construction.** From building the LightningModule to the end of the
hybrid strategy's setup, a rank's peak at pp = 4 and at tp = 2 stays within its 1/n share
of the one-process model plus one bucket and two of the largest parameter, and the
weights it initialized alone are exactly its part of the one-process init; the same
model built whole first (no ``init_weights``) exceeds the bound.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.checkpoints.dcp import save_directory
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.strategies import (
    GradientEngine,
    HybridParallelStrategy,
    PipelineExecutor,
    build_schedule,
    simulate,
)
from plugintrain.strategies.engine_checkpoint import EngineCheckpoint
from plugintrain.strategies.pipeline_stages import VirtualStage, split_model

from _harness import run_distributed
from _toy import ToyModel, ToyShape

WIDTH = 128
LAYERS = 8
BATCH = 2  # activations stay small next to the 8 x 64 KiB weight matrices


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def _layer_mb() -> float:
    return WIDTH * WIDTH * 4 / 2**20  # one bucket per layer


def _backward(model: nn.Module, passes: int) -> None:
    for _ in range(passes):
        model(torch.randn(BATCH, WIDTH)).square().mean().backward()


def _plain_peak(passes: int) -> int:
    """One step of plain PyTorch that keeps no gradient: the compute-only peak."""
    with LiveTensorMemory() as memory:
        model = _mlp()
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        _backward(model, passes)
        memory.reset_peak()
        _backward(model, passes)
    return memory.peak_bytes


def _engine_peak(stage: int, passes: int) -> int:
    """The peak of a steady-state step (the second) under the engine, everything counted."""
    with LiveTensorMemory() as memory:
        model = _mlp()
        engine = GradientEngine(model.named_parameters(), stage=stage, bucket_size_mb=_layer_mb())
        assert engine.num_buckets == LAYERS
        for _step in range(2):
            memory.reset_peak()
            with engine.no_sync():
                _backward(model, passes - 1)
            _backward(model, 1)
    return memory.peak_bytes


def _peaks(rank: int, world_size: int, root: str) -> dict:
    peaks: dict = {
        (stage, passes): _engine_peak(stage, passes) - _plain_peak(passes)
        for stage in (0, 1, 2)
        for passes in (1, 2)
    }
    peaks["pipeline"] = {layout: _pipeline_peak(rank, world_size, *layout) for layout in LAYOUTS}
    peaks["checkpoint"] = _checkpoint_peaks(rank, world_size, Path(root) / f"world{world_size}")
    layout = SETUP_LAYOUTS[world_size]
    peaks["setup"] = {build: _setup_peak(world_size, layout, build) for build in ("meta", "whole")}
    return peaks


# ---- sharded checkpoints -----------------------------------------------------------------


CHECKPOINT_BUCKET = 2 * WIDTH * WIDTH * 4  # two layers: parameters are views of a bucket


def _trained_zero2() -> tuple[nn.Module, GradientEngine, torch.optim.Optimizer]:
    model = _mlp()
    engine = GradientEngine(
        model.named_parameters(), stage=2, bucket_size_mb=CHECKPOINT_BUCKET / 2**20
    )
    optimizer = torch.optim.AdamW(model.parameters())
    engine.attach(optimizer)
    _backward(model, 1)
    optimizer.step()
    return model, engine, optimizer


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _checkpoint_peaks(rank: int, world_size: int, path: Path) -> dict[str, int]:
    """What a sharded save and load add to the peak, and what gathering the state adds."""
    model, engine, optimizer = _trained_zero2()
    saving = EngineCheckpoint(engine)
    with LiveTensorMemory() as memory:
        memory.track(model.parameters(), _state_tensors(optimizer))
        before = memory.live_bytes
        checkpoint = {"state_dict": model.state_dict()}
        checkpoint["optimizer_states"] = [saving.optimizer_state(optimizer)]
        save_directory(checkpoint, path, rank == 0, file_bytes=CHECKPOINT_BUCKET)
        saved = memory.peak_bytes - before
        del checkpoint
        memory.reset_peak()
        before = memory.live_bytes
        gathered = engine.optimizer_state_dict(optimizer)  # the single-file way: all on rank 0
        gather = memory.peak_bytes - before
        del gathered
    model, engine, optimizer = _trained_zero2()  # other weights; its state is replaced
    optimizer.state.clear()
    loading = EngineCheckpoint(engine)
    with LiveTensorMemory() as memory:
        memory.track(model.parameters())
        loading.load(path, model, [optimizer])
        # The loaded state stays (it is the optimizer's); the rest was transient.
        load = memory.peak_bytes - memory.live_bytes
    return {"save": saved, "load": load, "gather": gather}


# ---- pipeline buffers ------------------------------------------------------------------

MICROBATCHES = 16
LAYOUTS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
SEQ = 8


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _one_microbatch(stage: VirtualStage, shape: ToyShape) -> int:
    """Bytes one micro-batch leaves alive after its forward through ``stage``."""
    with LiveTensorMemory() as memory:
        memory.track(stage.model.parameters())  # weights (and views of them) are not its
        before = memory.live_bytes
        if stage.is_first:
            x = torch.randint(0, shape.vocab_size, (1, SEQ))
        else:
            x = torch.randn(1, SEQ, shape.n_embd, requires_grad=True)
        out = stage(x, SEQ)
        if stage.is_last:
            out = _loss(out, torch.randint(0, shape.vocab_size, (1, SEQ)))
        held = memory.live_bytes - before
        del x, out
    return held


def _pipeline_peak(rank: int, pp: int, schedule: str, vpp: int) -> dict[str, int]:
    torch.manual_seed(0)
    shape = ToyShape(n_layer=pp * vpp)
    model = ToyModel(shape)
    stages = split_model(model, rank, pp, vpp)
    executor = PipelineExecutor(
        stages, schedule, pp, vpp, MICROBATCHES, rank, None, _loss, hidden_size=shape.n_embd
    )
    tokens = torch.randint(0, shape.vocab_size, (MICROBATCHES, SEQ + 1))
    inputs, targets = (
        list(tokens[:, :-1].chunk(MICROBATCHES)),
        list(tokens[:, 1:].chunk(MICROBATCHES)),
    )
    executor.train_step(inputs, targets)  # gradients exist from here on
    with LiveTensorMemory() as memory:
        memory.track(model.parameters(), [p.grad for p in model.parameters()])
        memory.reset_peak()
        before = memory.live_bytes
        executor.train_step(inputs, targets)
        step_peak = memory.peak_bytes - before
    per_microbatch = max(_one_microbatch(stage, shape) for stage in stages)
    return {"step": step_peak, "microbatch": per_microbatch}


@pytest.fixture(scope="module")
def grad_peaks() -> Iterator[dict[int, list[dict]]]:
    with tempfile.TemporaryDirectory() as root:
        yield {world: run_distributed(_peaks, world, root) for world in (2, 4)}


TOTAL = LAYERS * WIDTH * WIDTH * 4  # gradient bytes of the whole model
BUCKET = WIDTH * WIDTH * 4


@pytest.mark.parametrize("passes", [1, 2], ids=["step", "accumulate2"])
@pytest.mark.parametrize("world", [2, 4])
def test_zero2_holds_a_shard_plus_two_buckets(
    grad_peaks: dict[int, list[dict]], world: int, passes: int
) -> None:
    bound = TOTAL // world + 2 * BUCKET + (BUCKET // world if passes > 1 else 0)
    for rank_peaks in grad_peaks[world]:
        assert rank_peaks[(2, passes)] <= bound, (rank_peaks[(2, passes)], bound)
        # The bound is tight enough to tell ZeRO-2 from keeping every full gradient.
        assert bound < TOTAL


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_and_zero1_hold_the_full_gradients(
    grad_peaks: dict[int, list[dict]], world: int, stage: int
) -> None:
    for rank_peaks in grad_peaks[world]:
        for passes in (1, 2):
            assert rank_peaks[(stage, passes)] >= TOTAL


def _allowed_in_flight(schedule: str, vpp: int, pp: int, rank: int) -> int:
    if schedule == "gpipe":
        return MICROBATCHES
    if schedule == "1f1b":
        return min(pp - rank, MICROBATCHES)
    return simulate(build_schedule(schedule, pp, vpp, MICROBATCHES)).peak_in_flight[rank]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}-vpp{layout[1]}")
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_rank_holds_its_in_flight_microbatches(
    grad_peaks: dict[int, list[dict]], pp: int, layout: tuple[str, int]
) -> None:
    schedule, vpp = layout
    for rank, rank_peaks in enumerate(grad_peaks[pp]):
        got = rank_peaks["pipeline"][layout]
        allowed = _allowed_in_flight(schedule, vpp, pp, rank)
        boundary = SEQ * ToyShape.n_embd * 4  # one micro-batch of one sequence, fp32
        bound = (allowed + 1) * got["microbatch"] + boundary
        assert got["step"] <= bound, (rank, got, allowed)
        if schedule == "gpipe":  # the measurement sees GPipe keep every micro-batch
            assert got["step"] >= (MICROBATCHES - 1) * got["microbatch"], (rank, got)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_save_and_load_add_at_most_one_bucket(
    grad_peaks: dict[int, list[dict]], world: int
) -> None:
    for rank, rank_peaks in enumerate(grad_peaks[world]):
        got = rank_peaks["checkpoint"]
        assert got["save"] <= CHECKPOINT_BUCKET, (rank, got)
        assert got["load"] <= CHECKPOINT_BUCKET, (rank, got)
        if rank == 0:  # gathering puts every rank's AdamW state (2 x the model) on rank 0
            assert got["gather"] >= 2 * TOTAL * (world - 1) // world, got


# ---- shard-first construction ----------------------------------------------------------

SETUP_LAYOUTS = {4: {"pipeline_parallel": 4, "microbatches": 4}, 2: {"tensor_parallel": 2}}
SETUP_BUCKET_MB = 0.25


def _setup_config() -> TransformerConfig:
    # Layers dominate (untied, small vocabulary), so an even split is visible in bytes.
    return TransformerConfig.from_name(
        "llama3-debug", n_layer=8, vocab_size=64, n_embd=128, block_size=16, tie_embeddings=False
    )


class _WholeBuild(CausalLM):
    """The same model without ``init_weights``: every rank builds all of it first."""

    init_weights = None  # type: ignore[assignment]


class _AfterSetup(L.Callback):
    """Reads the tracker once the strategy has set up the model, then ends the run."""

    def __init__(self, memory: LiveTensorMemory) -> None:
        self.memory = memory
        self.seen: dict = {}

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen["peak"] = self.memory.peak_bytes  # before gathering the weights below
        self.seen["params"] = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()
        }
        raise _Stop


class _Stop(Exception):
    pass


def _setup_peak(world_size: int, layout: dict, build: str) -> dict:
    """Peak bytes from building the module to the end of the strategy's setup."""
    L.seed_everything(0, verbose=False)
    memory = LiveTensorMemory()
    after = _AfterSetup(memory)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=1, logger=False,
        strategy=HybridParallelStrategy(bucket_size_mb=SETUP_BUCKET_MB, **layout),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[after],
    )  # fmt: skip
    tokens = torch.randint(0, 64, (8, 17))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    with memory, contextlib.suppress(_Stop):
        module = (CausalLM if build == "meta" else _WholeBuild)(_setup_config())
        trainer.fit(module, data)
    return after.seen


def _single_process_model() -> dict:
    L.seed_everything(0, verbose=False)
    with LiveTensorMemory() as memory:
        module = CausalLM(_setup_config())
        module.configure_model()
    params = dict(module.named_parameters())
    return {
        "bytes": memory.live_bytes,
        "params": params,
        "largest": max(p.numel() * p.element_size() for p in params.values()),
    }


@pytest.mark.parametrize("world", [4, 2], ids=["pp4", "tp2"])
def test_shard_first_setup_holds_about_one_nth(
    grad_peaks: dict[int, list[dict]], world: int
) -> None:
    """Each rank's peak from construction to the end of setup is at most its 1/n share of
    the one-process model, plus one gradient bucket (the engine packs parameters into
    bucket buffers one bucket at a time) and two of the largest parameter (the one being
    packed or initialized, and tp's replicated norms and a stage's embedding or head
    beyond the even share). Building the whole model first exceeds that bound."""
    single = _single_process_model()
    bound = single["bytes"] // world + SETUP_BUCKET_MB * 2**20 + 2 * single["largest"]
    assert bound < single["bytes"]
    for rank_peaks in grad_peaks[world]:
        meta, whole = rank_peaks["setup"]["meta"], rank_peaks["setup"]["whole"]
        assert meta["peak"] <= bound, (meta["peak"], bound)
        assert whole["peak"] >= single["bytes"], (whole["peak"], single["bytes"])
        # The weights each rank initialized alone are its part of the one-process init.
        assert meta["params"], "every rank holds some parameters"
        for name, value in meta["params"].items():
            torch.testing.assert_close(value, single["params"][name], rtol=0, atol=0, msg=name)
