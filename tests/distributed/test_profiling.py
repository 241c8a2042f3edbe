"""Phase profiling (plugintrain.core.profiling, PhaseProfiler) and the TensorBoard tags.

One world of 2 gloo ranks runs every distributed case: the gradient engine at stages 0, 2
and parameter server, the pipeline executor (1F1B and interleaved), a Lightning fit under
the pipeline strategy with the PhaseProfiler, and a whole ``plugintrain fit`` through the
CLI under ``zero2`` with Lightning's ``simple`` profiler, ``--profile_phases`` and FP16,
whose TensorBoard events are read back. Counts are checked against what the layout
implies (one reduction per bucket of one parameter, one transfer per micro-batch),
never against timings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.callbacks import PhaseProfiler
from plugintrain.callbacks.phase_profiler import summary_table
from plugintrain.cli import PluginTrainCLI
from plugintrain.core import profiling
from plugintrain.data.token_bin import write_token_bin
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import GradientEngine, PipelineExecutor, PipelineStrategy
from plugintrain.strategies.pipeline_stages import split_model

from _harness import run_distributed
from _toy import ToyModel, ToyShape

VOCAB, SEQ, BYTES_PER_TOKEN = 97, 16, 3
MICROBATCHES = 4
FIT_STEPS = 2
CLI_STEPS = 3
INIT_SCALE = 256.0
PEAK_LR = 3e-3

# ---- one process --------------------------------------------------------------------------


def test_record_is_one_shared_no_op_when_off() -> None:
    assert profiling.active() is None
    assert profiling.record("forward") is profiling.record("backward")
    with profiling.record("forward"):
        pass  # nothing to record into, nothing recorded


def test_ranges_nest_per_thread_and_make_a_chrome_trace() -> None:
    with profiling.recording(profiling.Recorder()) as recorder, profiling.record("outer"):
        with profiling.record("inner"):
            pass
        with profiling.record("inner"):
            pass
    assert profiling.active() is None
    assert [(r.name, r.parent) for r in recorder.ranges] == [
        ("inner", "outer"),
        ("inner", "outer"),
        ("outer", None),
    ]
    outer = recorder.ranges[-1]
    assert all(outer.start_ns <= r.start_ns for r in recorder.ranges)
    trace = json.loads(json.dumps(profiling.chrome_trace(recorder.ranges, rank=3)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["inner", "inner", "outer"]
    for event in complete:
        assert event["pid"] == 3 and event["dur"] >= 0 and event["ts"] > 1e15  # µs, epoch
    totals = profiling.phase_totals(recorder.ranges)
    assert (totals["inner"].count, totals["outer"].count) == (2, 1)
    assert totals["inner"].seconds <= totals["outer"].seconds


def test_summary_table_lists_phases_with_spread() -> None:
    totals = {
        "train_step": profiling.PhaseTotal(4, 2.0),
        "forward": profiling.PhaseTotal(4, 0.5),
        "mine": profiling.PhaseTotal(1, 0.1),
    }
    table = summary_table(totals, {"train_step": (2.0, 2.5), "forward": (0.4, 0.5)}, 4)
    lines = table.splitlines()
    assert lines[0].startswith("Phase profile: 4 training steps")
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert rows["forward"][1:5] == ["4", "0.500", "125.00", "25.0%"]
    assert rows["forward"][5:] == ["0.400", "0.500"]
    assert rows["train_step"][4] == "100.0%" and "mine" in rows


# ---- the distributed cases ----------------------------------------------------------------


def _ranges(recorder: profiling.Recorder) -> list[tuple[str, str | None, int]]:
    return [(r.name, r.parent, r.step) for r in recorder.ranges]


def _engine_case(stage: Any) -> dict[str, Any]:
    """One backward and one optimizer step of a 4-parameter model, one bucket each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = GradientEngine(model.named_parameters(), stage=stage, bucket_size_mb=1e-6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    with profiling.recording(profiling.Recorder()) as recorder:
        loss = model(torch.randn(4, 8)).square().mean()
        with profiling.record(profiling.BACKWARD):
            loss.backward()
        with profiling.record(profiling.OPTIMIZER):
            optimizer.step()
    engine.remove()
    return {"ranges": _ranges(recorder), "params": len(list(model.parameters()))}


def _toy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _executor_case(rank: int, schedule: str, vpp: int) -> list[tuple[str, str | None, int]]:
    torch.manual_seed(0)
    shape = ToyShape(n_layer=2 * vpp)
    stages = split_model(ToyModel(shape), rank, 2, vpp)
    executor = PipelineExecutor(
        stages, schedule, 2, vpp, MICROBATCHES, rank, None, _toy_loss, shape.n_embd,
        record_range=profiling.record,
    )  # fmt: skip
    tokens = torch.randint(0, shape.vocab_size, (MICROBATCHES, 1, 9))
    with profiling.recording(profiling.Recorder()) as recorder:
        executor.train_step(list(tokens[..., :-1]), list(tokens[..., 1:]))
    return _ranges(recorder)


def _pipeline_fit(root: Path) -> dict[str, Any]:
    """A Lightning fit under ``pipeline`` (pp 2, ZeRO-1) with the PhaseProfiler."""
    L.seed_everything(0, verbose=False)
    config = TransformerConfig.from_name(
        "gpt2-debug", n_layer=2, vocab_size=VOCAB, n_embd=32, block_size=SEQ
    )
    module = CausalLM(config, functools.partial(torch.optim.SGD, lr=0.1), warmup_steps=0)
    tokens = torch.randint(0, VOCAB, (FIT_STEPS * 4, SEQ + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    profiler = PhaseProfiler(skip_first=0, max_steps=None, dirpath=str(root / "pipeline"))
    strategy = PipelineStrategy(pipeline_parallel=2, microbatches=2, zero_stage=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[FP32Precision()],
        max_steps=FIT_STEPS, logger=False, enable_checkpointing=False, callbacks=[profiler],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, data)
    trace = json.loads(Path(profiler.trace_path).read_text())
    return {"ranges": _ranges(profiler.recorder), "summary": profiler.summary, "trace": trace}


def _write_data(directory: Path) -> None:
    """Random token files over VOCAB ids, each id spelling BYTES_PER_TOKEN bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    for name, count in (("train.bin", 4096), ("val.bin", 1024)):
        write_token_bin(directory / name, gen.integers(0, VOCAB, count))
    np.save(directory / "token_bytes.npy", np.full(VOCAB, BYTES_PER_TOKEN, dtype=np.int64))


def _cli_recipe(root: Path) -> Path:
    config = TransformerConfig.from_name(
        "gpt2-debug", n_layer=2, vocab_size=VOCAB, n_embd=32, block_size=SEQ
    )
    recipe = {
        "trainer": {
            "accelerator": "cpu", "devices": 2, "strategy": "zero2", "max_steps": CLI_STEPS,
            "log_every_n_steps": 1, "val_check_interval": CLI_STEPS, "limit_val_batches": 1,
            "num_sanity_val_steps": 0, "enable_progress_bar": False,
            "enable_model_summary": False,
            "plugins": [{
                "class_path": "plugintrain.precision_plugins.FP16MixedPrecision",
                "init_args": {"init_scale": INIT_SCALE},
            }],
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(root / "cli"), "name": "tb"},
            },
        },
        "model": {
            "class_path": "plugintrain.model_zoo.CausalLM",
            "init_args": {
                "config": dataclasses.asdict(config),
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": PEAK_LR}},
                "warmup_steps": 2,
            },
        },
        "data": {
            "class_path": "plugintrain.data.TokenDataModule",
            "init_args": {"data_dir": str(root / "data"), "seq_len": SEQ, "batch_size": 4},
        },
        "throughput": {"window_size": 2},
    }  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _cli_fit(rank: int, root: Path) -> dict[str, Any]:
    """``plugintrain fit`` under zero2 with Lightning's simple profiler and ours."""
    if rank == 0:
        _write_data(root / "data")
        _cli_recipe(root)
    torch.distributed.barrier()
    args = ["fit", f"--config={root / 'recipe.yaml'}", "--trainer.profiler=simple"]
    cli = PluginTrainCLI(args=[*args, "--profile_phases=true"])
    (phases,) = [c for c in cli.trainer.callbacks if isinstance(c, PhaseProfiler)]
    lightning_profiler = cli.trainer.profiler
    return {
        "ranges": _ranges(phases.recorder),
        "summary": phases.summary,
        "trace": json.loads(Path(phases.trace_path).read_text()),
        "lightning_profiler": type(lightning_profiler).__name__,
        "lightning_actions": {k: len(v) for k, v in lightning_profiler.recorded_durations.items()},
        "log_dir": cli.trainer.log_dir,
    }


def _world2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {
        "engine": {stage: _engine_case(stage) for stage in (0, 2, "parameter_server")},
        "executor": {
            "1f1b": _executor_case(rank, "1f1b", 1),
            "interleaved": _executor_case(rank, "interleaved", 2),
        },
        "pipeline_fit": _pipeline_fit(Path(root)),
        "cli": _cli_fit(rank, Path(root)),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_world2, 2, str(tmp_path_factory.mktemp("profiling")), timeout=600)


# ---- the gradient engine ------------------------------------------------------------------

ENGINE_PHASES = {
    0: ("grad_all_reduce", None),
    2: ("grad_reduce_scatter", "param_all_gather"),
    "parameter_server": ("grad_reduce", "param_broadcast"),
}


@pytest.mark.parametrize("stage", list(ENGINE_PHASES), ids=str)
def test_engine_records_one_reduction_per_bucket_inside_backward(
    world2: list[dict[str, Any]], stage: Any
) -> None:
    reduce_name, sync_name = ENGINE_PHASES[stage]
    for rank in world2:
        case = rank["engine"][stage]
        buckets = case["params"]  # a bucket per parameter at this bucket size
        names = Counter(name for name, _, _ in case["ranges"])
        assert names[reduce_name] == buckets
        parents = {parent for name, parent, _ in case["ranges"] if name == reduce_name}
        assert parents == {"backward"}
        other_comm = {n for n in names if n.startswith(("grad_", "param_"))} - {
            reduce_name,
            sync_name,
        }
        assert not other_comm
        if sync_name is None:
            assert not any(n.startswith("param_") for n in names)
            continue
        assert names[sync_name] == buckets
        assert {p for n, p, _ in case["ranges"] if n == sync_name} == {"optimizer"}


# ---- the pipeline executor ----------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "vpp"), [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_records_each_micro_batch_and_transfer(
    world2: list[dict[str, Any]], schedule: str, vpp: int
) -> None:
    for rank, result in enumerate(world2):
        names = Counter(name for name, _, _ in result["executor"][schedule])
        # Each rank runs vpp chunks; each chunk runs every micro-batch forward and back.
        assert names["forward"] == names["backward"] == MICROBATCHES * vpp
        # 2 * vpp stages alternate between the ranks, so each of the 2 * vpp - 1 stage
        # boundaries joins the two ranks and carries, per micro-batch, one activation
        # forward and one gradient back: each rank sends and receives one per boundary.
        transfers = (2 * vpp - 1) * MICROBATCHES
        assert names["pipeline_recv_wait"] == names["pipeline_send_wait"] == transfers
        assert names["pipeline_post"] >= 1
        assert all(parent is None for _, parent, _ in result["executor"][schedule]), rank


def test_pipeline_fit_profiles_micro_batches_not_the_whole_step(
    world2: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(world2):
        ranges = result["pipeline_fit"]["ranges"]
        names = Counter(name for name, _, _ in ranges)
        assert names["train_step"] == names["optimizer"] == FIT_STEPS
        assert names["forward"] == names["backward"] == 2 * FIT_STEPS  # 2 micro-batches
        assert {p for n, p, _ in ranges if n in ("forward", "backward")} == {"train_step"}
        assert {p for n, p, _ in ranges if n == "optimizer"} == {"train_step"}
        assert {p for n, p, _ in ranges if n == "param_all_gather"} == {"optimizer"}  # ZeRO-1
        steps = Counter(step for n, _, step in ranges if n == "forward")
        assert steps == {0: 2, 1: 2}
        events = [e for e in result["pipeline_fit"]["trace"]["traceEvents"] if e["ph"] == "X"]
        assert len(events) == len(ranges) and {e["pid"] for e in events} == {rank}
    assert "forward" in world2[0]["pipeline_fit"]["summary"]
    assert world2[1]["pipeline_fit"]["summary"] == ""  # printed on rank 0 only


# ---- the CLI: Lightning's profiler, --profile_phases, TensorBoard --------------------------


def test_cli_runs_lightnings_simple_profiler_with_a_plugintrain_strategy(
    world2: list[dict[str, Any]],
) -> None:
    for result in world2:
        cli = result["cli"]
        assert cli["lightning_profiler"] == "SimpleProfiler"
        assert cli["lightning_actions"]["[Strategy]ZeroStrategy.training_step"] == CLI_STEPS
        assert cli["lightning_actions"]["[Strategy]ZeroStrategy.backward"] == CLI_STEPS


def test_cli_profile_phases_traces_zero2_on_every_rank(world2: list[dict[str, Any]]) -> None:
    profiled = CLI_STEPS - 1  # the PhaseProfiler skips the first step by default
    for rank, result in enumerate(world2):
        ranges = result["cli"]["ranges"]
        names = Counter(name for name, _, _ in ranges)
        for phase in ("train_step", "forward", "backward", "optimizer"):
            assert names[phase] == profiled, phase
        assert {p for n, p, _ in ranges if n == "grad_reduce_scatter"} == {"backward"}
        assert {p for n, p, _ in ranges if n == "param_all_gather"} == {"optimizer"}
        assert names["grad_reduce_scatter"] == names["param_all_gather"]  # per bucket
        trace = result["cli"]["trace"]
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert events and all(e["pid"] == rank and e["dur"] >= 0 for e in events)
        assert Path(result["cli"]["log_dir"], f"phases_rank{rank}.json").is_file()
    table = world2[0]["cli"]["summary"].splitlines()
    assert [line.split()[0] for line in table[3:7]] == [
        "train_step",
        "forward",
        "backward",
        "optimizer",
    ]


def _scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_tags_are_logged_and_consistent(world2: list[dict[str, Any]]) -> None:
    scalars = _scalars(world2[0]["cli"]["log_dir"])
    expected = {
        "train_loss", "train_ppl", "train_bpb", "val_loss", "val_ppl", "val_bpb",
        "lr/pg1", "lr/pg2", "grad_norm", "loss_scale",
        "throughput/tokens_per_sec", "throughput/device/tokens_per_sec",
    }  # fmt: skip
    assert expected <= set(scalars), sorted(scalars)
    for tag in expected:
        assert all(math.isfinite(v) for v in scalars[tag].values()), tag
    loss = scalars["train_loss"]
    assert sorted(loss) == list(range(CLI_STEPS))
    for step, value in loss.items():
        assert scalars["train_ppl"][step] == pytest.approx(math.exp(value), rel=1e-5)
        bpb = value / (BYTES_PER_TOKEN * math.log(2))
        assert scalars["train_bpb"][step] == pytest.approx(bpb, rel=1e-5)
    (val_step,) = scalars["val_loss"]
    val_loss = scalars["val_loss"][val_step]
    assert scalars["val_ppl"][val_step] == pytest.approx(math.exp(val_loss), rel=1e-4)
    assert scalars["val_bpb"][val_step] == pytest.approx(
        val_loss / (BYTES_PER_TOKEN * math.log(2)), rel=1e-4
    )
    assert scalars["lr/pg1"] == scalars["lr/pg2"]
    assert all(0 < lr <= PEAK_LR * (1 + 1e-6) for lr in scalars["lr/pg1"].values())  # fp32
    assert set(scalars["loss_scale"].values()) == {INIT_SCALE}  # no overflow at this size
    assert all(v > 0 for v in scalars["grad_norm"].values())
    assert all(v > 0 for v in scalars["throughput/tokens_per_sec"].values())
    assert "memory/peak_bytes" not in scalars  # CUDA only
