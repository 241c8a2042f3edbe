"""The scaling calculator against published runs: predicted next to measured, with sources.

Each row is a run whose layout, batch, sequence length and cluster were published; the
calculator (``plugintrain estimate --time``, :mod:`plugintrain.estimate.timing`) prices
the same layout on the named cluster preset, from the model's shapes, and the ratio is
predicted / published in the source's own metric. Nothing here is fitted to these rows:
the presets' bandwidths and efficiencies are the documented defaults.

    .venv/bin/python benchmarks/scaling_calculator.py          # the README's table
    .venv/bin/python benchmarks/scaling_calculator.py --json out.json

About 2 minutes on two CPU cores (the 1T model's 64-stage, 512-micro-batch schedule is
simulated action by action).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

from plugintrain.estimate import Layout
from plugintrain.estimate.timing import CLUSTERS, formula_costs, predict
from plugintrain.model_zoo import TransformerConfig

LLAMA3 = "The Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
MEGATRON = (
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using"
    " Megatron-LM (arXiv:2104.04473), Table 1; Megatron-LM README"
)
TITAN = "torchtitan docs/performance.md (torch 2024-12-23, torchtitan 9dec370)"
# Llama 3 405B: 126 layers over 16 x 2 virtual stages, one layer fewer on the first and
# the last (the paper's balancing of the embedding and the head).
LLAMA3_SPLIT = (3, *[4] * 30, 3)


@dataclass(frozen=True)
class Run:
    """A published run and the layout that reproduces it."""

    name: str
    model: str
    overrides: dict[str, Any]
    layout: dict[str, Any]
    cluster: str
    metric: str
    """``mfu``, ``tflops_megatron`` (Megatron's count, recomputation included) or
    ``tokens_per_gpu``."""
    published: float
    source: str
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


RUNS = [
    Run("Llama 3.1 405B, 8,192 H100", "llama3.1-405b", {},
        dict(dp=64, tp=8, sp=True, pp=16, vpp=2, zero_stage=1, microbatches=32,
             layers_per_stage=LLAMA3_SPLIT, micro_batch=1, seq_len=8192),
        "h100-roce", "mfu", 0.43, LLAMA3,
        "tp8 x pp16 x dp64, 16M tokens per batch; 430 TFLOP/s per GPU"),
    Run("Llama 3.1 405B, 16,384 H100", "llama3.1-405b", {},
        dict(dp=128, tp=8, sp=True, pp=16, vpp=2, zero_stage=1, microbatches=16,
             layers_per_stage=LLAMA3_SPLIT, micro_batch=1, seq_len=8192),
        "h100-roce", "mfu", 0.41, LLAMA3,
        "tp8 x pp16 x dp128, 16M tokens per batch; 400 TFLOP/s per GPU"),
    Run("GPT 1T, 3,072 A100", "gpt2-124m",
        dict(n_layer=128, n_embd=25600, n_head=160, vocab_size=51200, block_size=2048),
        dict(dp=6, tp=8, pp=64, zero_stage=0, microbatches=512, micro_batch=1,
             seq_len=2048, recompute="full"),
        "a100-ib", "tflops_megatron", 163e12, MEGATRON,
        "tp8 x pp64 x dp6, batch 3072, full recomputation; 502 PFLOP/s in all"),
    Run("Llama 3.1 8B, 8 H100 (FSDP)", "llama3.1-8b", {},
        dict(dp=8, zero_stage=3, micro_batch=2, seq_len=8192, recompute="selective"),
        "h100-roce", "tokens_per_gpu", 5762, TITAN,
        "Table 1, FSDP without compile or Float8; 500 W HBM2e H100s"),
    Run("Llama 3.1 8B, 128 H100 (FSDP)", "llama3.1-8b", {},
        dict(dp=128, zero_stage=3, micro_batch=2, seq_len=8192, recompute="selective"),
        "h100-roce", "tokens_per_gpu", 5605, TITAN,
        "Table 3, FSDP without compile or Float8; 500 W HBM2e H100s"),
]  # fmt: skip


def megatron_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Megatron-LM's FLOPs per token with full recomputation (the paper's equation 3
    divided by ``B s``): ``96 l h^2 (1 + s / 6h + V / 16 l h)``."""
    layers, h, vocab = config.n_layer, config.n_embd, config.vocab_size
    return 96 * layers * h**2 * (1 + seq_len / (6 * h) + vocab / (16 * layers * h))


def predicted_metric(run: Run) -> tuple[float, Any]:
    """The calculator's figure for ``run`` in the source's metric, and the prediction."""
    config = TransformerConfig.from_name(run.model, **run.overrides)
    layout = Layout.of("hybrid", precision="bf16-mixed", **run.layout)
    cluster = CLUSTERS[run.cluster]
    prediction = predict(formula_costs(config, layout), config, layout, cluster)
    if run.metric == "mfu":
        return prediction.mfu, prediction
    if run.metric == "tflops_megatron":
        per_token = megatron_flops_per_token(config, layout.seq_len)
        return prediction.tokens_per_second_per_gpu * per_token, prediction
    return prediction.tokens_per_second_per_gpu, prediction


def _shown(metric: str, value: float) -> str:
    if metric == "mfu":
        return f"MFU {value:.1%}"
    if metric == "tflops_megatron":
        return f"{value / 1e12:.0f} TFLOP/s"
    return f"{value:,.0f} tokens/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    start = time.monotonic()
    rows = []
    print("| run | cluster preset | published | predicted | predicted / published | notes |")
    print("|---|---|---:|---:|---:|---|")
    for run in RUNS:
        value, prediction = predicted_metric(run)
        ratio = value / run.published
        rows.append({"run": run.name, "published": run.published, "predicted": value,
                     "ratio": ratio, "step_time": prediction.step_time,
                     "breakdown": prediction.breakdown, "source": run.source})  # fmt: skip
        print(
            f"| {run.name} | {run.cluster} | {_shown(run.metric, run.published)} |"
            f" {_shown(run.metric, value)} | {ratio:.3f} | {run.notes} |"
        )
    print(f"\n{time.monotonic() - start:.0f} s; sources:")
    for source in dict.fromkeys(run.source for run in RUNS):
        print(f"- {source}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
