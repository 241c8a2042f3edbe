"""Context parallelism on real gloo ranks: tokens/s and per-rank memory at cp 1, 2 and 4,
one command::

    .venv/bin/python benchmarks/context_parallel.py [--cp 1 2 4] [--seq 4096 8192 16384]
        [--steps 2] [--warmup 1] [--json PATH]

The model is llama3-debug (4 layers, 4 query and 2 key/value heads of 32 channels) with its
vocabulary cut to 8,192 and ``block_size`` the longest row: at the 128k-entry vocabulary
one process would need 25 GB for the logits of a 16,384-token row alone. One row a step,
fp32, every token a target, SGD. For each cp degree, ``cp`` processes start once (gloo,
``2 // cp`` or one intra-op thread each: the machine's cores shared out), build the same
seeded weights, and run every length: ``--warmup`` steps, then ``--steps`` timed ones.

Reported per degree and length:

- **tokens/s**: the row's tokens over the median step time (the cp ranks train one row
  together); the ratio is against cp 1 in the same command;
- **activation peak per rank**: the largest live-tensor total during a step, less what
  lived before it (weights and their gradient buffers), measured by
  :class:`~plugintrain.core.memory.LiveTensorMemory`, which sees every tensor an operator
  makes, gathered keys and values included (the issue's bar: at most 0.3x cp 1's at 16,384);
- **peak RSS per rank** (the largest of the ranks'), for what the process holds besides.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 8192


def _model(seq: int) -> torch.nn.Module:
    from plugintrain.model_zoo import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig.from_name("llama3-debug", vocab_size=VOCAB, block_size=seq)
    return Transformer(config)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    from plugintrain.model_zoo.cross_entropy import token_cross_entropy

    logits = model(x)
    target = y if model.context is None else model.context.take(y)
    loss = token_cross_entropy(logits, target)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad, alpha=0.1)
            p.grad.zero_()
    return float(loss.detach())


def _measure(model: torch.nn.Module, seq: int, steps: int, warmup: int) -> dict[str, Any]:
    from plugintrain.core.memory import LiveTensorMemory

    generator = torch.Generator().manual_seed(seq)
    x = torch.randint(0, VOCAB, (1, seq), generator=generator)
    y = torch.randint(0, VOCAB, (1, seq), generator=generator)
    for _ in range(warmup):
        _step(model, x, y)
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        _step(model, x, y)
        times.append(time.perf_counter() - start)
    held = [*model.parameters(), *(p.grad for p in model.parameters())]
    with LiveTensorMemory() as memory:
        memory.track(*held)
        before = memory.live_bytes
        _step(model, x, y)
    return {"seconds": statistics.median(times), "activation_peak": memory.peak_bytes - before}


def _rank(rank: int, cp: int, port: int, lengths: list[int], steps: int, warmup: int, out: str):
    from plugintrain.core.context_shard import ContextShard

    torch.set_num_threads(max(1, 2 // cp))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    model = _model(max(lengths))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if cp > 1:
        model.context = ContextShard(cp, rank, dist.group.WORLD)
    results = {seq: _measure(model, seq, steps, warmup) for seq in lengths}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out, f"{rank}.json").write_text(json.dumps({"results": results, "rss": rss}))
    dist.destroy_process_group()


def run_degree(cp: int, lengths: list[int], steps: int, warmup: int) -> dict[str, Any]:
    """Every length on ``cp`` fresh gloo ranks; per length the slowest rank's step time
    and the largest rank's activation peak, and the largest rank's peak RSS."""
    with tempfile.TemporaryDirectory() as out:
        port = 29000 + os.getpid() % 1000 + cp
        mp.start_processes(
            _rank, args=(cp, port, lengths, steps, warmup, out), nprocs=cp, start_method="spawn"
        )
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(cp)]
    table = {}
    for seq in lengths:
        seconds = max(r["results"][str(seq)]["seconds"] for r in ranks)
        peak = max(r["results"][str(seq)]["activation_peak"] for r in ranks)
        table[seq] = {"tokens_per_s": seq / seconds, "activation_peak": peak}
    return {"lengths": table, "rss": max(r["rss"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {cp: run_degree(cp, args.seq, args.steps, args.warmup) for cp in args.cp}
    base = results.get(1)
    print(f"llama3-debug, vocab {VOCAB}, one row a step, fp32, {os.cpu_count()} CPU threads")
    print("| cp | seq | tokens/s | vs cp 1 | activation peak / rank | vs cp 1 | peak RSS / rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for cp, result in results.items():
        for seq, row in result["lengths"].items():
            ref = base["lengths"][seq] if base else None
            speed = f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
            mem = f"{row['activation_peak'] / ref['activation_peak']:.3f}x" if ref else "-"
            print(
                f"| {cp} | {seq:,} | {row['tokens_per_s']:,.0f} | {speed} |"
                f" {row['activation_peak'] / 2**20:,.1f} MiB | {mem} |"
                f" {result['rss'] / 2**30:.2f} GiB |"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
