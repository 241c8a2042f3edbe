"""The scaling calculator against published runs: predicted next to measured, with sources.

Each row is a run whose layout, batch, sequence length and cluster were published; the
calculator (``plugintrain estimate --time``, :mod:`plugintrain.estimate.timing`) prices
the same layout on the named cluster preset, from the model's shapes, and the ratio is
predicted / published in the source's own metric. Nothing here is fitted to these rows:
the presets' bandwidths and efficiencies are the documented defaults, and each run is
priced on the preset of the hardware its source describes (torchtitan's H100s on
``h100-500w-roce``: HBM2e at 2.4 TB/s and a 500 W power limit, as its performance page
says). Where a published run recomputed more than plugintrain would in the same layout
(Megatron-LM reran the whole layer; torchtitan's op policy reruns every second matmul),
the row adds that work to the costs (``Run.rerun``), so that what is priced is what the
run executed.

    .venv/bin/python benchmarks/scaling_calculator.py          # the README's table
    .venv/bin/python benchmarks/scaling_calculator.py --json out.json

A few seconds on two CPU cores (most of it the 1T model's 64-stage, 512-micro-batch
schedule, simulated action by action).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugintrain.estimate import Layout
from plugintrain.estimate.timing import (
    CLUSTERS,
    Collective,
    Link,
    StageCost,
    _act_bytes,
    formula_costs,
    microbatches,
    predict,
)
from plugintrain.model_zoo import TransformerConfig
from plugintrain.strategies.pipeline_stages import rank_stages, stage_layer_keys

LLAMA3 = "The Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
MEGATRON = (
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using"
    " Megatron-LM (arXiv:2104.04473), Table 1; Megatron-LM README"
)
TITAN = (
    "torchtitan docs/performance.md at d4c86e3 (2025-01-30; measured with torchtitan 9dec370,"
    " torch 2024-12-23)"
)
TITAN_2024 = (
    "torchtitan docs/performance.md at 4d88a8a (2024-12-03): Llama 3 on 64 A100 80GB with"
    " FSDP2 (published 2024-04), Llama 3.1 405B on 128 H100 (2024-08)"
)
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
    rerun: Callable[[list[StageCost], TransformerConfig, Layout], list[StageCost]] | None = None
    """Adds the recomputation the published run did beyond plugintrain's in this layout."""
    precision: str = "bf16-mixed"
    """The dtypes the run moved its activations and gradients in (``bf16-true``: half
    precision throughout, as Megatron-LM's fp16 mode ran; the A100's fp16 and bf16 peaks
    are the same)."""


def _rerun_more(
    costs: list[StageCost],
    config: TransformerConfig,
    layout: Layout,
    weights: Callable[[int], float],
    tp_all_reduces: int = 0,
) -> list[StageCost]:
    """``costs`` plus, per block and micro-batch, a rerun of ``weights(block)`` parameters'
    matmuls and ``tp_all_reduces`` more tensor-parallel all-reduces of its output (without
    sequence parallelism, where a row-parallel output is all-reduced)."""
    dims, m = layout.dims, microbatches(layout)
    if tp_all_reduces and dims.sequence_parallel:
        raise ValueError("a rerun under sequence parallelism reduce-scatters; not modelled")
    tokens = layout.micro_batch * layout.seq_len
    stages = dims.pp * dims.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.pipeline.layers_per_stage)
    out = []
    for cost in costs:
        mine = rank_stages(cost.pp_rank, dims.pp, dims.vpp)
        blocks = [int(k) for s in mine for k in keys[s]]
        flops = sum(2 * tokens * weights(b) / dims.tp * m for b in blocks)
        extra = ()
        if dims.tp > 1 and tp_all_reduces:
            count = tp_all_reduces * len(blocks) * m
            size = count * tokens * config.n_embd * _act_bytes(layout)  # a matmul's output
            extra = (Collective("all_reduce", "tp", dims.tp, count, size),)
        matmul = cost.matmul_flops + flops
        out.append(
            dataclasses.replace(cost, matmul_flops=matmul, collectives=cost.collectives + extra)
        )
    return out


def megatron_whole_layer(
    costs: list[StageCost], config: TransformerConfig, layout: Layout
) -> list[StageCost]:
    """What Megatron-LM (2021) executed beyond plugintrain in the same layout: its full
    recomputation reran the whole layer, so also the last matmul (the FFN's down
    projection) and the all-reduce after it, which
    plugintrain's checkpoint, stopping once backward has what it needs, skips; and its
    attention, not fused, computed the whole square of scores (the causal mask applied
    after), twice the causal work."""

    def down(block: int) -> float:  # its weights: 2 FLOPs per multiply-add
        return config.block_flops(block, layout.seq_len).down / 2

    rerun = _rerun_more(costs, config, layout, down, tp_all_reduces=1)
    return [dataclasses.replace(c, attention_flops=2 * c.attention_flops) for c in rerun]


def titan_op_policy(
    costs: list[StageCost], config: TransformerConfig, layout: Layout
) -> list[StageCost]:
    """torchtitan's selective "op" policy saves every compute op's output except every
    second matmul's, counted per block: of the block's seven (wq, wk, wv, wo, w1, w3, w2 in
    order) backward reruns wk, wo and w3 (plugintrain's selective policy keeps all seven)."""
    h, kv = config.n_embd, config.kv_heads * config.head_dim
    rerun = h * kv + config.n_head * config.head_dim * h + h * config.ffn_dim
    return _rerun_more(costs, config, layout, lambda b: rerun)


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
    Run("Llama 3.1 405B, 16,384 H100, 131k context", "llama3.1-405b", {},
        dict(dp=8, tp=8, sp=True, pp=16, vpp=2, cp=16, zero_stage=1, microbatches=16,
             layers_per_stage=LLAMA3_SPLIT, micro_batch=1, seq_len=131072),
        "h100-roce", "mfu", 0.38, LLAMA3,
        "tp8 x cp16 x pp16 x dp8, 16M tokens per batch; 380 TFLOP/s per GPU"),
    Run("GPT 1T, 3,072 A100", "gpt2-124m",
        dict(n_layer=128, n_embd=25600, n_head=160, vocab_size=51200, block_size=2048),
        dict(dp=6, tp=8, pp=64, zero_stage=0, microbatches=512, micro_batch=1,
             seq_len=2048, recompute="full"),
        "a100-ib", "tflops_megatron", 163e12, MEGATRON,
        "tp8 x pp64 x dp6, batch 3072, whole-layer recomputation, fp16; 502 PFLOP/s in all",
        megatron_whole_layer, "bf16-true"),
    Run("Llama 3.1 8B, 8 H100 (FSDP)", "llama3.1-8b", {},
        dict(dp=8, zero_stage=3, micro_batch=2, seq_len=8192, recompute="selective"),
        "h100-500w-roce", "tokens_per_gpu", 5762, TITAN,
        "Table 1, FSDP without compile or Float8, op recomputation (added); HBM2e H100s"
        " at 500 W",
        titan_op_policy),
    Run("Llama 3.1 8B, 128 H100 (FSDP)", "llama3.1-8b", {},
        dict(dp=128, zero_stage=3, micro_batch=2, seq_len=8192, recompute="selective"),
        "h100-500w-roce", "tokens_per_gpu", 5605, TITAN,
        "Table 3, FSDP without compile or Float8, op recomputation (added); HBM2e H100s"
        " at 500 W",
        titan_op_policy),
    Run("Llama 3 8B, 64 A100 (FSDP)", "llama3.1-8b", {},
        dict(dp=64, zero_stage=3, micro_batch=1, seq_len=8192, recompute="full",
             every_n_layers=2),
        "a100-ib", "tokens_per_gpu", 2904, TITAN_2024,
        "FSDP2, selective layer recomputation (every 2nd block, torchtitan's default);"
        " network not published"),
    Run("Llama 3 8B, 64 A100 (FSDP, op policy)", "llama3.1-8b", {},
        dict(dp=64, zero_stage=3, micro_batch=1, seq_len=8192, recompute="selective"),
        "a100-ib", "tokens_per_gpu", 2973, TITAN_2024,
        "FSDP2, selective op recomputation; network not published", titan_op_policy),
    Run("Llama 3 70B, 64 A100 (FSDP)", "llama3.1-70b", {},
        dict(dp=64, zero_stage=3, micro_batch=1, seq_len=8192, recompute="full"),
        "a100-ib", "tokens_per_gpu", 331, TITAN_2024,
        "FSDP2, full recomputation; network not published"),
    Run("Llama 3.1 405B, 128 H100 (FSDP x TP)", "llama3.1-405b", {},
        dict(dp=16, tp=8, sp=True, zero_stage=3, micro_batch=2, seq_len=8192,
             recompute="full"),
        "h100-500w-roce", "tokens_per_gpu", 109, TITAN_2024,
        "FSDP2 16 x TP8, full recomputation, no Float8 or async TP; HBM2e H100s at 500 W"),
]  # fmt: skip


def megatron_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Megatron-LM's FLOPs per token with full recomputation (the paper's equation 3
    divided by ``B s``): ``96 l h^2 (1 + s / 6h + V / 16 l h)``."""
    layers, h, vocab = config.n_layer, config.n_embd, config.vocab_size
    return 96 * layers * h**2 * (1 + seq_len / (6 * h) + vocab / (16 * layers * h))


FREE = Link(float("inf"), 0.0)
"""A link that takes no time: what the calculator predicts when only the compute counts."""


def predicted_metric(run: Run, free_links: bool = False) -> tuple[float, Any]:
    """The calculator's figure for ``run`` in the source's metric, and the prediction
    (``free_links``: with every collective and send taking no time)."""
    config = TransformerConfig.from_name(run.model, **run.overrides)
    layout = Layout.of("hybrid", precision=run.precision, **run.layout)
    cluster = CLUSTERS[run.cluster]
    if free_links:
        cluster = dataclasses.replace(cluster, intra=FREE, inter=FREE)
    costs = formula_costs(config, layout)
    if run.rerun is not None:
        costs = run.rerun(costs, config, layout)
    prediction = predict(costs, config, layout, cluster)
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


def _where(prediction: Any) -> str:
    """The step's two largest parts, as shares of it."""
    parts = sorted(prediction.breakdown.items(), key=lambda kv: -kv[1])[:2]
    return ", ".join(f"{name} {t / prediction.step_time:.0%}" for name, t in parts if t > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    start = time.monotonic()
    rows = []
    print(
        "| run | cluster preset | published | predicted | predicted / published"
        " | predicted step goes to | with free links / published | notes |"
    )
    print("|---|---|---:|---:|---:|---|---:|---|")
    for run in RUNS:
        value, prediction = predicted_metric(run)
        ratio = value / run.published
        free = predicted_metric(run, free_links=True)[0] / run.published
        rows.append(
            {
                "run": run.name,
                "published": run.published,
                "predicted": value,
                "ratio": ratio,
                "free_links_ratio": free,
                "step_time": prediction.step_time,
                "breakdown": prediction.breakdown,
                "source": run.source,
            }
        )
        print(
            f"| {run.name} | {run.cluster} | {_shown(run.metric, run.published)} |"
            f" {_shown(run.metric, value)} | {ratio:.3f} | {_where(prediction)} | {free:.3f} |"
            f" {run.notes} |"
        )
    print(f"\n{time.monotonic() - start:.0f} s; sources:")
    for source in dict.fromkeys(run.source for run in RUNS):
        print(f"- {source}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
