"""Throughput and memory of tensor (+ sequence) parallelism on 4 CPU processes.

    .venv/bin/python benchmarks/hybrid.py [--seq-len 128] [--batch-size 8] [--steps 5]

For the GPT-2 and Llama 3 debug models (vocabulary cut to 8192 and 4 key/value heads, so
tp=4 divides them), runs one process, then 4 gloo processes with tp=1 (dp=4, ZeRO-0),
tp=2 (dp=2) and tp=4 (dp=1), with and without sequence parallelism, all on the same
global batch. Prints a Markdown
table of tokens/s (global), peak RSS per rank, and each rank's parameter + gradient +
optimizer-state bytes. Timing excludes ``--warmup`` steps. Processes are forked per row,
so each row's peak RSS is its own (it includes the ~0.3 GiB of the imported libraries).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import gather
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plugintrain.model_zoo import Transformer, TransformerConfig, gpt2, llama3
from plugintrain.strategies import ParallelDims, parallelize, vocab_parallel_loss

WORLD = 4
VOCAB = 8192
PLANS = {"gpt2-debug": gpt2.tp_plan(), "llama3-debug": llama3.tp_plan()}
# tp=4 must divide the vocabulary and the key/value heads (Llama debug has 2).
OVERRIDES = {"vocab_size": VOCAB, "n_kv_head": 4}
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _train(preset: str, tp: int, sp: bool, world: int, args: argparse.Namespace) -> dict:
    """Train on this rank; return tokens/s of the whole group and this rank's memory."""
    torch.manual_seed(0)
    config = TransformerConfig.from_name(preset, block_size=args.seq_len, **OVERRIDES)
    model = Transformer(config)
    engine = None
    dp = 1
    if world > 1:
        dims = ParallelDims(world, tensor_parallel=tp, sequence_parallel=sp)
        dims.validate_model(config, args.seq_len)
        mesh = dims.build_mesh()
        engine = parallelize(model, PLANS[preset] if tp > 1 else None, dims, mesh)
        dp = dims.dp
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if engine is not None:
        engine.attach(optimizer)
    loss_fn = vocab_parallel_loss(_loss) if tp > 1 else _loss
    rows = args.batch_size // dp
    tokens = torch.randint(0, VOCAB, (rows, args.seq_len + 1))
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        with loss_parallel() if tp > 1 else torch.enable_grad():
            loss.backward()
        optimizer.step()
        state = _state_bytes(model, optimizer, engine)
        optimizer.zero_grad()
    elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / elapsed,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "state_mib": state / 2**20,
    }


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: object) -> int:
    params = sum(_bytes(p) for p in model.parameters())
    if engine is not None:
        grads = engine.grad_bytes()
    else:
        grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = optimizer.state.values()
    return params + grads + sum(_bytes(v) for s in states for v in s.values() if v.dim() > 0)


def _worker(rank: int, port: int, job: tuple, args: argparse.Namespace, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the cores; oversubscription stalls gloo
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    results.put((rank, _train(*job, WORLD, args)))
    # Only after a result: a rank that raised leaves its peers blocked in a collective, and
    # destroying the group would wait for them; `gather` stops them instead.
    dist.destroy_process_group()


def _run_distributed(preset: str, tp: int, sp: bool, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=_worker, args=(r, port, (preset, tp, sp), args, results))
        for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    by_rank = gather(results, procs, timeout=600)
    return [by_rank[r] for r in range(WORLD)]


def _run_single(preset: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def target() -> None:
        torch.set_num_threads(1)
        results.put((0, _train(preset, 1, False, 1, args)))

    proc = ctx.Process(target=target)
    proc.start()
    return gather(results, [proc], timeout=600)[0]


def main() -> None:
    args = _parse()
    print("| model | layout | tokens/s | peak RSS / rank (MiB) | params+grads+optim / rank (MiB) |")
    print("|---|---|---:|---:|---:|")
    for preset in PLANS:
        single = _run_single(preset, args)
        print(
            f"| {preset} | 1 process | {single['tokens_per_s']:,.0f} |"
            f" {single['peak_rss_mib']:,.0f} | {single['state_mib']:.1f} |"
        )
        for tp, sp in LAYOUTS:
            ranks = _run_distributed(preset, tp, sp, args)
            layout = f"dp={WORLD // tp} x tp={tp}" + (" +SP" if sp else "")
            rss = max(r["peak_rss_mib"] for r in ranks)
            state = max(r["state_mib"] for r in ranks)
            tps = min(r["tokens_per_s"] for r in ranks)  # the slowest rank sets the pace
            print(f"| {preset} | {layout} | {tps:,.0f} | {rss:,.0f} | {state:.1f} |")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, divisible by 4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    main()
