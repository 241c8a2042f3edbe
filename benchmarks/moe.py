"""Mixture of experts on CPU: expert-parallel throughput and all-to-all share, and expert
load balance with and without DeepSeek-V3's routing bias.

    .venv/bin/python benchmarks/moe.py [--ep 1 2 4] [--steps 12] [--balance-steps 200]
        [--rates 0 0.001 0.01] [--out runs/bench/moe-<time>]

Needs ``plugintrain prepare shakespeare --tokenizer gpt2``. Two parts, each against a
baseline run in the same command:

1. **Expert parallelism** (baseline: ep=1). For each ``--ep``, ``plugintrain fit`` of
   ``recipes/deepseek_v3_debug_shakespeare_cpu.yaml`` on ``ep`` processes (gloo, one
   intra-op thread each, as a GPU has one stream) with ``expert_parallel=ep``: every
   rank reads its own batch of 8 x 128 tokens and holds ``8 / ep`` of each MoE layer's
   experts. ``--profile_phases`` records every step's ranges; from the Chrome traces:
   tokens/s (the step's tokens over the median step time of the slowest rank), and the
   share of the step spent in the expert all-to-alls (``expert_all_to_all``: counts and
   tokens out, outputs back, forward and backward).
2. **Balancing** (baseline: no bias, rate 0). One process trains the same model on the
   same batches for ``--balance-steps`` steps with each ``bias_update_rate``; the
   routing statistics logged after every step give the expert-load imbalance (busiest
   expert's load / mean load, averaged over the MoE layers) over time, printed at a few
   steps and drawn to ``imbalance.png``.

Results: ``results.json`` and ``imbalance.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "deepseek_v3_debug_shakespeare_cpu.yaml"
TOKENS_PER_RANK = 8 * 128


def _fit(ep: int, steps: int, out: Path) -> Path:
    """Run the recipe on ``ep`` processes; the directory holding its phase traces."""
    log_dir = out / f"ep{ep}"
    command = [
        str(REPO / ".venv" / "bin" / "plugintrain"), "fit", "--config", str(RECIPE),
        f"--trainer.devices={ep}",
        f"--trainer.strategy.init_args.expert_parallel={ep}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--checkpoint.dirpath={log_dir / 'checkpoints'}",
        "--profile_phases=true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return log_dir


def _ranges(trace: Path, name: str) -> list[float]:
    """Durations in seconds of the ranges called ``name`` in one rank's Chrome trace."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e["dur"] / 1e6 for e in events if e.get("name") == name and "dur" in e]


def _expert_parallel_row(ep: int, steps: int, out: Path) -> dict[str, float]:
    traces = sorted(_fit(ep, steps, out).rglob("phases_rank*.json"))
    if len(traces) != ep:
        raise RuntimeError(f"ep={ep}: expected {ep} phase traces, found {traces}")
    step_times = [_ranges(t, "train_step") for t in traces]
    slowest = [max(per_rank) for per_rank in zip(*step_times, strict=True)]
    shares = [
        sum(_ranges(t, "expert_all_to_all")) / sum(s)
        for t, s in zip(traces, step_times, strict=True)
    ]
    step = statistics.median(slowest)
    return {
        "ep": ep,
        "step_s": step,
        "tokens_per_s": ep * TOKENS_PER_RANK / step,
        "tokens_per_s_per_rank": TOKENS_PER_RANK / step,
        "all_to_all_share": statistics.mean(shares),
    }


def _balance_curve(rate: float, steps: int, out: Path) -> list[float]:
    """Mean imbalance over the MoE layers after each of ``steps`` steps at ``rate``."""
    import lightning as L
    import torch

    from plugintrain.data import TokenDataModule
    from plugintrain.model_zoo import CausalLM, TransformerConfig

    L.seed_everything(1337)
    torch.set_num_threads(1)
    preset = TransformerConfig.from_name("deepseek-v3-debug")
    config = dataclasses.replace(preset, moe=dataclasses.replace(preset.moe, bias_update_rate=rate))
    module = CausalLM(config, warmup_steps=20, lr_decay_steps=steps)
    data = TokenDataModule(
        data_dir=str(REPO / "data" / "shakespeare_gpt2"), seq_len=128, batch_size=8
    )
    logs = out / f"balance-{rate}"
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        log_every_n_steps=1,
        gradient_clip_val=1.0,
        logger=L.pytorch.loggers.CSVLogger(logs, name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    with open(logs / "metrics.csv") as f:
        return [float(row["moe/imbalance"]) for row in csv.DictReader(f) if row["moe/imbalance"]]


def _plot(curves: dict[float, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rate, curve in curves.items():
        label = "no bias (baseline)" if rate == 0 else f"bias_update_rate {rate:g}"
        ax.plot(range(1, len(curve) + 1), curve, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max / mean expert load")
    ax.set_title("deepseek-v3-debug on Shakespeare, mean over MoE layers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _print_expert_parallel(rows: list[dict[str, float]]) -> None:
    base = rows[0]
    print(f"\nexpert parallelism, deepseek-v3-debug, {TOKENS_PER_RANK} tokens per rank and step")
    print("ep  step ms  tokens/s  ratio  tokens/s/rank  ratio  all-to-all share")
    for r in rows:
        print(
            f"{r['ep']:<3} {r['step_s'] * 1e3:7.0f}  {r['tokens_per_s']:8,.0f}"
            f"  {r['tokens_per_s'] / base['tokens_per_s']:4.2f}x"
            f"  {r['tokens_per_s_per_rank']:13,.0f}"
            f"  {r['tokens_per_s_per_rank'] / base['tokens_per_s_per_rank']:4.2f}x"
            f"  {r['all_to_all_share']:16.1%}"
        )


def _print_balance(curves: dict[float, list[float]]) -> None:
    steps = len(next(iter(curves.values())))
    marks = sorted({1, 10, 25, 50, 100, 150, steps} & set(range(1, steps + 1)))
    print("\nexpert-load imbalance (max / mean, mean over MoE layers) by step")
    print("bias_update_rate  " + "  ".join(f"{m:>6}" for m in marks) + "  last 20 vs baseline")
    baseline = statistics.mean(curves[0.0][-20:]) if 0.0 in curves else None
    for rate, curve in curves.items():
        tail = statistics.mean(curve[-20:])
        ratio = f"{tail / baseline:.2f}x" if baseline else "-"
        print(f"{rate:<16g}  " + "  ".join(f"{curve[m - 1]:6.2f}" for m in marks) + f"  {ratio}")


def main(argv: list[str] | None = None) -> int:
    """Run both parts; print the tables; write ``results.json`` and ``imbalance.png``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--balance-steps", type=int, default=200)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.001, 0.01])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or REPO / "runs" / "bench" / f"moe-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=False)
    rows = [_expert_parallel_row(ep, args.steps, out) for ep in args.ep]
    _print_expert_parallel(rows)
    curves = {rate: _balance_curve(rate, args.balance_steps, out) for rate in args.rates}
    _print_balance(curves)
    _plot(curves, out / "imbalance.png")
    (out / "results.json").write_text(
        json.dumps(
            {"expert_parallel": rows, "imbalance": {str(r): c for r, c in curves.items()}}, indent=1
        )
    )
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
