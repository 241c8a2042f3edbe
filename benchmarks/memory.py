"""Peak memory of the mechanisms that exist to save it, each against its baseline.

    .venv/bin/python benchmarks/memory.py [--world 2] [--pp 2 4] [--steps 8]

Every figure is a peak measured by :class:`plugintrain.core.memory.LiveTensorMemory`, which
sees every tensor an operator allocates (on CUDA the allocator's peak would be used).

1. **ZeRO gradients** (``--world`` gloo processes, Llama 3 debug with an 8,192-token
   vocabulary, 0.25 MiB buckets so the model spans many): what the gradients add to
   the peak of a training step (the step's peak under the engine minus the peak of plain
   PyTorch on the same model dropping each gradient as soon as it is made), for DDP
   (baseline, stage 0), ZeRO-1 and ZeRO-2, with and without gradient accumulation; then
   tokens/s of DDP and ZeRO-2 without the tracker and their ratio, with 1 MiB buckets (7,
   as a large model's 25 MiB buckets are many) and with the table's 0.25 MiB (28 tiny
   collectives a step, where ZeRO-2's wait for the previous bucket shows on gloo).
2. **Pipeline buffers** (``--pp`` gloo processes, Llama 3 debug with 2 x pp blocks, 8
   micro-batches of 2 x 128 tokens): each rank's peak activation and boundary bytes
   during a step (beyond weights and gradients), GPipe (baseline) against 1F1B and
   interleaved 1F1B (vpp=2, chunks of half a stage).
3. **Shard-first construction** (``--construct`` presets, default Llama 3 debug and Llama
   3.2 1B): each rank's peak tensor bytes and peak RSS from building the LightningModule
   to the end of ``HybridParallelStrategy.setup`` at pp = 4 and at tp = 2, against one
   process building the whole model (baseline).
4. **Sharded checkpoints** (``--world`` processes, ZeRO-2, the model of 1. after one AdamW
   step): what saving and loading the optimizer and model add to each rank's peak, the
   sharded DCP directory against gathering the whole state to rank 0 and writing one file
   (baseline; loading it puts the whole state on every rank before slicing).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import gather
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.checkpoints.dcp import save_directory
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig
from plugintrain.strategies import (
    GradientEngine,
    HybridParallelStrategy,
    PipelineExecutor,
    split_model,
)
from plugintrain.strategies.engine_checkpoint import EngineCheckpoint

VOCAB = 8192
SEQ = 128
BUCKET_MB = 0.25
SPEED_BUCKETS_MB = (1.0, BUCKET_MB)  # tokens/s: 7 buckets (as a large model has), then 28
MiB = 2**20


def _config(n_layer: int = 4) -> TransformerConfig:
    return TransformerConfig.from_name(
        "llama3-debug", vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer
    )


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _batch(rows: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


# ---- 1. ZeRO gradients ---------------------------------------------------------------------


def _step(model: Transformer, passes: int, engine: GradientEngine | None) -> None:
    for index in range(passes):
        x, y = _batch(2)
        last = index == passes - 1
        with engine.no_sync() if engine is not None and not last else torch.enable_grad():
            _loss(model(x), y).backward()


def _plain_peak(passes: int) -> int:
    with LiveTensorMemory() as memory:
        torch.manual_seed(0)
        model = Transformer(_config())
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        _step(model, passes, None)
        memory.reset_peak()
        _step(model, passes, None)
    return memory.peak_bytes


def _engine(model: Transformer, stage: int, bucket_mb: float = BUCKET_MB) -> GradientEngine:
    return GradientEngine(model.named_parameters(), stage=stage, bucket_size_mb=bucket_mb)


def _engine_peak(stage: int, passes: int) -> tuple[int, int]:
    with LiveTensorMemory() as memory:
        torch.manual_seed(0)
        model = Transformer(_config())
        engine = _engine(model, stage)
        _step(model, passes, engine)
        memory.reset_peak()
        _step(model, passes, engine)
    return memory.peak_bytes, engine.num_buckets


def _speeds(steps: int, rounds: int = 5) -> dict[tuple[float, int], float]:
    """Median tokens/s of DDP and ZeRO-2 per bucket size, the runs interleaved."""
    runs: dict[tuple[float, int], list[float]] = {}
    for _ in range(rounds):
        for mb in SPEED_BUCKETS_MB:
            for stage in (0, 2):
                runs.setdefault((mb, stage), []).append(_tokens_per_s(stage, steps, mb))
    return {key: statistics.median(values) for key, values in runs.items()}


def _tokens_per_s(stage: int, steps: int, bucket_mb: float) -> float:
    torch.manual_seed(0)
    model = Transformer(_config())
    engine = _engine(model, stage, bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.attach(optimizer)
    for step in range(steps + 2):
        if step == 2:
            dist.barrier()
            start = time.perf_counter()
        _step(model, 1, engine)
        optimizer.step()
        optimizer.zero_grad()
    return steps * 2 * SEQ * dist.get_world_size() / (time.perf_counter() - start)


def _zero(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    total = sum(p.numel() * 4 for p in Transformer(_config()).parameters())
    out: dict[str, Any] = {"total": total}
    for passes in (1, 2):
        plain = _plain_peak(passes)
        for stage in (0, 1, 2):
            peak, buckets = _engine_peak(stage, passes)
            out[(stage, passes)] = peak - plain
            out["buckets"] = buckets
    out["tokens_per_s"] = _speeds(args.steps)
    return out


# ---- 2. pipeline buffers ------------------------------------------------------------------

MICROBATCHES = 8
LAYOUTS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def _pipeline(rank: int, pp: int, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for schedule, vpp in LAYOUTS:
        torch.manual_seed(0)
        model = Transformer(_config(n_layer=2 * pp))  # the same model for every schedule
        stages = split_model(model, rank, pp, vpp)
        executor = PipelineExecutor(
            stages, schedule, pp, vpp, MICROBATCHES, rank, None, _loss, model.config.n_embd
        )
        x, y = _batch(2 * MICROBATCHES)
        inputs, targets = list(x.chunk(MICROBATCHES)), list(y.chunk(MICROBATCHES))
        executor.train_step(inputs, targets)  # gradients exist from here on
        with LiveTensorMemory() as memory:
            memory.track(model.parameters(), [p.grad for p in model.parameters()])
            before = memory.live_bytes
            memory.reset_peak()
            executor.train_step(inputs, targets)
        out[schedule] = memory.peak_bytes - before
    return out


# ---- 3. shard-first construction ------------------------------------------------------------

CONSTRUCT_LAYOUTS = {
    "pp=4": {"pipeline_parallel": 4, "microbatches": 4},
    "tp=2": {"tensor_parallel": 2},
}


class _SetUp(Exception):
    """Raised once the strategy has set the model up: the run ends there."""


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _construct_alone(rank: int, world: int, preset: str) -> dict[str, int]:
    """The baseline: one process builds (and initializes) the whole model."""
    torch.manual_seed(0)
    start = time.perf_counter()
    with LiveTensorMemory() as memory:
        module = CausalLM(preset)
        module.configure_model()
    return {"peak": memory.peak_bytes, "rss": _rss_bytes(), "s": time.perf_counter() - start}


def _construct_sharded(rank: int, world: int, job: tuple[str, str]) -> dict[str, int]:
    """Build the module and let HybridParallelStrategy set it up; stop before training."""
    preset, layout = job
    # A torchrun-like environment: Lightning joins the group the worker already started.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    memory, seen = LiveTensorMemory(), {}

    class Stop(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seen["peak"] = memory.peak_bytes
            raise _SetUp

    torch.manual_seed(0)
    strategy = HybridParallelStrategy(**CONSTRUCT_LAYOUTS[layout])
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
        callbacks=[Stop()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    tokens = torch.zeros(4, 17, dtype=torch.long)
    start = time.perf_counter()
    with memory, contextlib.suppress(_SetUp):
        trainer.fit(CausalLM(preset), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:])))
    return {"peak": seen["peak"], "rss": _rss_bytes(), "s": time.perf_counter() - start}


def _construct_table(preset: str, alone: dict[str, int], by_layout: dict[str, list]) -> str:
    rows = [
        f"Shard-first construction, {preset}: peak tensor MiB (peak RSS MiB) per rank from"
        " building the module to the end of the strategy's setup",
        "",
        "| layout | "
        + " | ".join(f"rank {r}" for r in range(4))
        + " | largest rank vs one process |",
        "|---|" + "---:|" * 4 + "---:|",
        f"| one process (baseline) | {alone['peak'] / MiB:,.0f} ({alone['rss'] / MiB:,.0f})"
        + " |" * 4
        + " 1.00x |",
    ]
    for layout, ranks in by_layout.items():
        cells = [f"{r['peak'] / MiB:,.0f} ({r['rss'] / MiB:,.0f})" for r in ranks]
        cells += [""] * (4 - len(cells))
        ratio = max(r["peak"] for r in ranks) / alone["peak"]
        rows.append(f"| {layout} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(rows)


# ---- 4. sharded checkpoints ---------------------------------------------------------------


def _trained_zero2() -> tuple[Transformer, GradientEngine, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(_config())
    engine = _engine(model, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.attach(optimizer)
    _step(model, 1, engine)
    optimizer.step()
    return model, engine, optimizer


def _added_peak(job: Any, *existing: Any) -> tuple[int, float]:
    """Peak bytes ``job()`` adds to what is live, and its seconds."""
    with LiveTensorMemory() as memory:
        memory.track(*existing)
        before = memory.live_bytes
        start = time.perf_counter()
        job()
        seconds = time.perf_counter() - start
    return memory.peak_bytes - before, seconds


def _checkpoints(rank: int, world: int, root: str) -> dict[str, tuple[int, float]]:
    model, engine, optimizer = _trained_zero2()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    sharded = EngineCheckpoint(engine)
    path, single = Path(root) / "sharded", Path(root) / "single.pt"

    def save_sharded() -> None:
        checkpoint = {"state_dict": model.state_dict()}
        checkpoint["optimizer_states"] = [sharded.optimizer_state(optimizer)]
        save_directory(checkpoint, path, rank == 0, engine.bucket_bytes)

    def save_single() -> None:
        whole = engine.optimizer_state_dict(optimizer)  # gathered to rank 0
        if rank == 0:
            torch.save({"state_dict": model.state_dict(), "optimizer": whole}, single)
        dist.barrier()

    out = {"save": _added_peak(save_sharded, model.parameters(), state)}
    out["save_single"] = _added_peak(save_single, model.parameters(), state)
    out["load"] = _load_peak(lambda m, e, o: _sharded_load(m, e, o, path, rank, world))
    out["load_single"] = _load_peak(lambda m, e, o: _single_load(m, e, o, single))
    return out


def _sharded_load(
    model: Any, engine: Any, optimizer: Any, path: Path, rank: int, world: int
) -> None:
    EngineCheckpoint(engine).load(path, model, [optimizer])


def _single_load(model: Any, engine: GradientEngine, optimizer: Any, path: Path) -> None:
    checkpoint = torch.load(path, weights_only=True)  # the whole state, on every rank
    model.load_state_dict(checkpoint["state_dict"])
    engine.load_optimizer_state_dict(optimizer, checkpoint["optimizer"])


def _load_peak(load: Any) -> tuple[int, float]:
    """What loading adds beyond the optimizer state it leaves (this rank's shards)."""
    model, engine, optimizer = _trained_zero2()
    optimizer.state.clear()
    with LiveTensorMemory() as memory:
        memory.track(model.parameters())
        start = time.perf_counter()
        load(model, engine, optimizer)
        seconds = time.perf_counter() - start
        return memory.peak_bytes - memory.live_bytes, seconds


def _checkpoint_table(ranks: list[dict[str, tuple[int, float]]], world: int) -> str:
    rows = [
        f"Sharded checkpoints, ZeRO-2 x {world}, the model of the first table after one AdamW"
        " step: MiB added to the peak (seconds), per rank",
        "",
        "| | " + " | ".join(f"rank {r}" for r in range(world)) + " | largest rank vs baseline |",
        "|---|" + "---:|" * world + "---:|",
    ]
    for key, label, base in (
        ("save_single", "save: gather to rank 0, one file (baseline)", "save_single"),
        ("save", "save: DCP, each rank its shards", "save_single"),
        ("load_single", "load: whole file on every rank (baseline)", "load_single"),
        ("load", "load: DCP, each rank its shards", "load_single"),
    ):
        cells = [f"{r[key][0] / MiB:.2f} ({r[key][1]:.2f})" for r in ranks]
        ratio = max(r[key][0] for r in ranks) / max(r[base][0] for r in ranks)
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(rows)


# ---- processes and tables -------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, job: Any, args: Any, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the cores; oversubscription stalls gloo
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    results.put((rank, job(rank, world, args)))
    # Only after a result: a rank that raised leaves its peers blocked in a collective, and
    # destroying the group would wait for them; `gather` stops them instead.
    dist.destroy_process_group()


def _run(job: Any, world: int, args: argparse.Namespace) -> list[Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, job, args, results)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    by_rank = gather(results, procs, timeout=1800)
    return [by_rank[r] for r in range(world)]


def _zero_table(ranks: list[dict[str, Any]], world: int) -> str:
    rank0 = ranks[0]
    total = rank0["total"]
    rows = [
        f"ZeRO gradients, world {world}: Llama 3 debug, {total / MiB:.1f} MiB of gradients in"
        f" {rank0['buckets']} buckets; MiB the gradients add to a step's peak (largest rank)",
        "",
        "| stage | step | vs DDP | accumulate 2 | vs DDP |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {0: "DDP (baseline)", 1: "ZeRO-1", 2: "ZeRO-2"}
    for stage in (0, 1, 2):
        cells = []
        for passes in (1, 2):
            peak = max(r[(stage, passes)] for r in ranks)
            base = max(r[(0, passes)] for r in ranks)
            cells += [f"{peak / MiB:.2f}", f"{peak / base:.2f}x"]
        rows.append(f"| {names[stage]} | " + " | ".join(cells) + " |")
    speed = rank0["tokens_per_s"]
    rows.append("")
    for mb in SPEED_BUCKETS_MB:
        ddp, zero2 = speed[(mb, 0)], speed[(mb, 2)]
        rows.append(
            f"tokens/s with {mb:g} MiB buckets (median of 5 interleaved runs): DDP"
            f" {ddp:,.0f}, ZeRO-2 {zero2:,.0f}, ratio {zero2 / ddp:.2f}x"
        )
    return "\n".join(rows)


def _pipeline_table(ranks: list[dict[str, int]], pp: int) -> str:
    rows = [
        f"Pipeline buffers, pp={pp}, m={MICROBATCHES}: peak activation + boundary MiB per rank",
        "",
        "| schedule | " + " | ".join(f"rank {r}" for r in range(pp)) + " | vs GPipe (per rank) |",
        "|---|" + "---:|" * pp + "---|",
    ]
    for schedule, vpp in LAYOUTS:
        cells = [f"{ranks[r][schedule] / MiB:.2f}" for r in range(pp)]
        ratios = " ".join(f"{ranks[r][schedule] / ranks[r]['gpipe']:.3f}" for r in range(pp))
        label = "GPipe (baseline)" if schedule == "gpipe" else f"{schedule} (vpp={vpp})"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {ratios} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks for the ZeRO table")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    parser.add_argument("--steps", type=int, default=8, help="timed steps for tokens/s")
    parser.add_argument(
        "--construct", nargs="*", default=["llama3-debug", "llama3.2-1b"], help="presets for 3."
    )
    args = parser.parse_args()
    print(_zero_table(_run(_zero, args.world, args), args.world), end="\n\n", flush=True)
    for pp in args.pp:
        print(_pipeline_table(_run(_pipeline, pp, args), pp), end="\n\n", flush=True)
    for preset in args.construct:
        alone = _run(_construct_alone, 1, preset)[0]
        by_layout = {
            layout: _run(_construct_sharded, int(layout[-1]), (preset, layout))
            for layout in CONSTRUCT_LAYOUTS
        }
        print(_construct_table(preset, alone, by_layout), end="\n\n", flush=True)
    with tempfile.TemporaryDirectory() as root:
        ranks = _run(_checkpoints, args.world, root)
    print(_checkpoint_table(ranks, args.world), flush=True)


if __name__ == "__main__":
    main()
