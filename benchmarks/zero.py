"""Throughput and memory of the data-parallel strategies on the debug models (CPU, gloo).

Compares plugintrain's ``zero1``, ``zero2``, ``ddp_bucketed`` and ``parameter_server``
with Lightning's ``ddp`` and with torch's ``ZeroRedundancyOptimizer`` (under ``ddp``), all
training the same model with AdamW on 2 processes::

    .venv/bin/python benchmarks/zero.py --models gpt2-debug llama3-debug --steps 8

Each configuration runs in its own group of ``python benchmarks/zero.py --run ...``
processes, one per rank, each of which must exit with 0. Prints a markdown table: tokens/s
(after warm-up steps) with the ratio to Lightning's ``ddp``, optimizer-state MiB per rank
and peak RSS per rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from _launch import run_ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, TensorDataset

import plugintrain.strategies
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.strategies import optimizer_state_bytes

from _timing import StepTimer

plugintrain.strategies.register()  # zero1, zero2, hybrid, ... by name

CONFIGS = ["ddp", "torch_zero_optimizer", "ddp_bucketed", "zero1", "zero2", "parameter_server"]
LR = 3e-4


class _Meter(StepTimer):
    """Times steps after warm-up, and measures optimizer state and peak memory per rank."""

    def result(self, trainer: L.Trainer) -> dict[str, float]:
        trainer.strategy.barrier()
        seconds = time.perf_counter() - self.start
        optimizer = trainer.optimizers[0]
        optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
        per_rank = torch.tensor(
            [
                optimizer_state_bytes(optimizer) / 2**20,
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
            ]
        )
        gathered = [torch.zeros_like(per_rank) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, per_rank)
        return {
            "tokens_per_s": self.tokens / seconds,
            "optimizer_state_mib": [g[0].item() for g in gathered],
            "peak_rss_mib": [g[1].item() for g in gathered],
        }


def _model(config_name: str, preset: str) -> CausalLM:
    optimizer: Any = functools.partial(torch.optim.AdamW, lr=LR)
    if config_name == "torch_zero_optimizer":
        optimizer = functools.partial(
            ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW, lr=LR
        )
    return CausalLM(
        TransformerConfig.from_name(preset), optimizer, warmup_steps=1, lr_decay_steps=1000
    )


def _run(args: argparse.Namespace) -> None:
    L.seed_everything(0)
    model = _model(args.run, args.model)
    vocab = model.vocab_size
    samples = args.batch_size * 2 * (args.steps + args.warmup)
    tokens = torch.randint(0, vocab, (samples, args.seq_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    meter = _Meter(args.warmup)
    strategy = "ddp" if args.run == "torch_zero_optimizer" else args.run
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps + args.warmup,
        callbacks=[meter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    result = meter.result(trainer)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps(result))
    leave_process_group()


def leave_process_group() -> None:
    """Destroy the process group before Python exits (Lightning's teardown leaves it, so
    collectives such as the meter's still work after ``fit``).

    Destroying it joins gloo's worker threads while the interpreter is whole. Left alive,
    a worker that releases a finished collective's tensors once Python has begun
    finalizing must take the GIL for them, is ended by ``pthread_exit`` inside a
    ``noexcept`` destructor, and the rank aborts: "terminate called without an active
    exception" (see ``benchmarks/exit_check.py``).
    """
    dist.destroy_process_group()


def _table(
    results: dict[tuple[str, str], dict[str, Any]], models: list[str], configs: list[str]
) -> str:
    lines = [
        "| model | strategy | tokens/s | vs ddp | optimizer state MiB/rank | peak RSS MiB/rank |",
        "|---|---|---:|---:|---|---|",
    ]
    for model in models:
        base = results[(model, "ddp")]["tokens_per_s"]
        for config in configs:
            r = results[(model, config)]
            state = " / ".join(f"{x:.1f}" for x in r["optimizer_state_mib"])
            rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mib"])
            lines.append(
                f"| {model} | {config} | {r['tokens_per_s']:.0f} |"
                f" {r['tokens_per_s'] / base:.2f}x | {state} | {rss} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-debug", "llama3-debug"])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for config in args.configs:
                out = Path(tmp) / f"{model}-{config}.json"
                cmd = [
                    __file__,
                    "--run",
                    config,
                    "--model",
                    model,
                    "--out",
                    str(out),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--batch-size",
                    str(args.batch_size),
                    "--seq-len",
                    str(args.seq_len),
                ]
                for rank in run_ranks(cmd, 2, cwd=tmp):
                    if rank.returncode != 0:
                        raise RuntimeError(
                            f"{model} {config}: rank {rank.rank} exited {rank.returncode}:\n"
                            f"{rank.output[-3000:]}"
                        )
                results[(model, config)] = json.loads(out.read_text())
                print(model, config, results[(model, config)], flush=True)
    print(_table(results, args.models, args.configs))


if __name__ == "__main__":
    main()
