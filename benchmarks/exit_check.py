"""Run each strategy to process exit many times: every rank must exit with 0.

    python benchmarks/exit_check.py --runs 20                  # every strategy
    python benchmarks/exit_check.py --strategies zero2 --runs 2

Each run is a group of 2 processes, each started and waited for on its own
(``_launch.run_ranks``), that fits a tiny Llama for a few steps, runs the ZeRO benchmark's
collectives after ``fit`` (its meter: a barrier and an all_gather), drops the trainer,
leaves the process group as the benchmark does (``zero.leave_process_group``) and exits.
Each rank also reports the gloo threads still alive after leaving: none for the data- and
pipeline-parallel strategies; under tp, torch's DTensor caches keep the DeviceMesh and
its (idle) groups until exit.

Why it matters: a gloo worker thread alive at interpreter shutdown that releases the
last C++ reference to a tensor Python holds must take the GIL to drop the tensor's
Python object (torch >= 2.10 ties the two refcounts). Once Python is finalizing,
taking the GIL ends the thread with ``pthread_exit``, whose unwinding reaches a
``noexcept`` destructor: ``std::terminate``, "terminate called without an active
exception", exit code 134.

``--no-teardown`` skips leaving the group (the benchmark before the fix).
``--hold-gil-at-exit`` registers, before anything else, an exit handler that holds the
GIL into finalization: a worker with a tensor still to release at exit then aborts its
process every time instead of by chance, so a clean count is not luck of scheduling.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

# torch, Lightning and plugintrain are imported inside the functions that use them, so that
# `--hold-gil-at-exit` registers its handler before any of theirs.
STRATEGIES = ["zero1", "zero2", "ddp_bucketed", "ddp", "hybrid", "pipeline"]


def _hold_gil_at_exit() -> None:
    # Registered first, so it runs after every other exit handler; a builtin called from C
    # never checks for threads waiting on the GIL, so it keeps it until finalization.
    atexit.register(sum, range(20_000_000))


def _strategy(name: str) -> Any:
    from plugintrain.strategies import HybridParallelStrategy, PipelineStrategy

    if name == "hybrid":
        return HybridParallelStrategy(tensor_parallel=2)  # both ranks one tp group
    if name == "pipeline":
        return PipelineStrategy(microbatches=2)
    return name  # registered short names, and Lightning's "ddp"


def _gloo_threads() -> int:
    """Threads of this process that gloo started (Linux names them)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text() for t in os.listdir("/proc/self/task")]
    return sum("gloo" in name for name in names)


def _rank(args: argparse.Namespace) -> None:
    """One rank: fit, the benchmark's collectives after fit, leave the group, report."""
    rank = _fit_and_measure(args)
    if not args.no_teardown:
        gc.collect()  # the trainer and the model are gone, and the groups only they held
        from zero import leave_process_group

        leave_process_group()
    Path(f"{args.out}.rank{rank}").write_text(str(_gloo_threads()))


def _fit_and_measure(args: argparse.Namespace) -> int:
    """Fit a tiny Llama with ``args.rank_run``, then run the meter's collectives; returns
    this process's global rank."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from zero import _Meter

    from plugintrain.model_zoo import CausalLM, TransformerConfig

    L.seed_everything(0, verbose=False)
    config = TransformerConfig.from_name(
        "llama3-debug", n_layer=2, n_embd=32, vocab_size=64, block_size=16
    )
    model = CausalLM(config, warmup_steps=0)
    tokens = torch.randint(0, 64, (16, 17))
    meter = _Meter(warmup=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(args.rank_run), max_steps=3,
        callbacks=[meter], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    meter.result(trainer)
    return trainer.global_rank


def _check(strategy: str, args: argparse.Namespace, tmp: str) -> tuple[Counter, int]:
    """Run ``strategy``'s group ``args.runs`` times: exit codes of all ranks, and the most
    gloo threads any rank still had at the end."""
    from _launch import run_ranks

    codes: Counter = Counter()
    threads = 0
    for run in range(args.runs):
        out = Path(tmp) / f"{strategy}-{run}"
        command = [__file__, "--rank-run", strategy, "--out", str(out)]
        command += ["--no-teardown"] * args.no_teardown + ["--hold-gil-at-exit"] * args.hold_gil
        for rank in run_ranks(command, 2, cwd=tmp):
            codes[rank.returncode] += 1
            if rank.returncode != 0:
                print(f"  {strategy} run {run} rank {rank.rank}: exit {rank.returncode}")
                print("    " + "\n    ".join(rank.output.splitlines()[-4:]))
            report = Path(f"{out}.rank{rank.rank}")
            threads = max(threads, int(report.read_text()) if report.exists() else 0)
    return codes, threads


def main() -> None:
    args = _parse()
    if args.rank_run:
        _rank(args)
        return
    print("| strategy | rank exits | exit code 0 | other exit codes | gloo threads left |")
    print("|---|---:|---:|---|---:|")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            codes, threads = _check(strategy, args, tmp)
            others = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items()) if c != 0) or "-"
            row = f"| {strategy} | {sum(codes.values())} | {codes[0]} | {others} | {threads} |"
            print(row, flush=True)
            failed |= set(codes) != {0}
    print(json.dumps({"runs": args.runs, "ok": not failed}))
    sys.exit(1 if failed else 0)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    parser.add_argument("--runs", type=int, default=20, help="process groups per strategy")
    parser.add_argument("--no-teardown", action="store_true", help="keep the group at exit")
    parser.add_argument(
        "--hold-gil-at-exit", dest="hold_gil", action="store_true",
        help="hold the GIL into finalization, so a late release aborts every time",
    )  # fmt: skip
    parser.add_argument("--rank-run", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    if "--hold-gil-at-exit" in sys.argv and "--rank-run" in sys.argv:
        _hold_gil_at_exit()
    main()
