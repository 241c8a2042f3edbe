"""QLoRA against LoRA on a full-precision base (the baseline), in one command::

    .venv/bin/python benchmarks/qlora.py [--part memory|speed|all] [--json PATH]
        memory: [--memory-model llama3.2-1b] [--memory-seq-len 512] [--memory-steps 2]
        speed:  [--speed-model smollm2-135m] [--batch-size 4] [--seq-len 128] [--steps 8]

Two parts, each printing ratios against its baseline run in the same command.

**memory** (``--part memory``): the issue's setting. Llama 3.2 1B (the preset, random
weights), LoRA r=16 (alpha 32) on every attention and MLP projection, batch 1 x 512, one
process on the CPU, every weight and the adapters in bf16 (what ``precision: bf16-true``
holds), AdamW on the adapters. Each variant runs in a fresh process (the peak resident
set size, VmHWM, is per process) that builds the model the way plugintrain does: on the
meta device, adapters injected (the adapted layers' weights replaced by
:class:`~plugintrain.model_zoo.quantization.QuantizedWeight` for QLoRA), then allocated
and initialized layer by layer (a QLoRA weight drawn whole in bf16, quantized, let go:
the base never exists whole in bf16), then ``--memory-steps`` training steps. Variants:
``bf16 base`` (the baseline: LoRA with the frozen base in bf16), ``nf4`` and ``int8``.
Reported: peak RSS after building and over the steps, the bytes and bits per weight of
the quantized base (the packed parameters' exact size against the number of weights they
stand for), and the loss of each step.

**speed** (``--part speed``): the CPU recipe's setting. SmolLM2-135M (its real weights),
batch 4 x 128, fp32, LoRA r=16 alpha 32 dropout 0 on every attention and MLP projection,
plain PyTorch steps (forward, loss, backward, AdamW, zero_grad). Variants: ``lora`` (the
baseline: the fp32 base), ``nf4`` and ``int8``; built in one process, their steps
interleaved round by round (the order rotated) so that a change of load hits them alike;
tokens/s is the median step. Also the peak live tensor bytes of one step
(:class:`plugintrain.core.memory.LiveTensorMemory`, which sees every tensor).

Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lora import TARGETS  # every attention and MLP projection, as the LoRA benchmark

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.data.assets import PRETRAINED_MODELS
from plugintrain.model_zoo import CausalLM
from plugintrain.model_zoo.lora import LoRASpec, init_adapters, inject, quantized_weights

VARIANTS = {"bf16 base": None, "nf4": "nf4", "int8": "int8"}
SPEED_VARIANTS = {"lora": None, "nf4": "nf4", "int8": "int8"}
MiB = 2**20


def _vm_hwm() -> int:
    """Peak resident set size of this process so far, bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _build(model: str, quantize: str | None, dtype: torch.dtype, r: int) -> CausalLM:
    """The model as plugintrain builds it: meta, adapters (quantized base), then allocated
    and initialized (pretrained weights loaded, or drawn), each QLoRA weight quantized as
    it arrives."""
    torch.manual_seed(0)
    module = CausalLM(weights=model) if model in PRETRAINED_MODELS else CausalLM(model)
    with torch.device("meta"):
        module.configure_model()
    module.model.to(dtype)  # on meta: nothing allocated
    spec = LoRASpec(r=r, alpha=2.0 * r, target_modules=TARGETS, quantize=quantize)
    inject(module, spec)
    module.model.to_empty(device="cpu")
    with torch.no_grad():
        module.init_weights()
        init_adapters(module, seed=0)
    module.train()
    return module


def _batch(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _step(module: CausalLM, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    x, y = batch
    loss = module.loss_fn(module(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _base_bytes(module: CausalLM) -> tuple[int, int]:
    """(bytes, weights) of the quantized base: the packed parameters and the weights they
    stand for."""
    held = list(quantized_weights(module))
    return sum(q.packed.numel() for _, q in held), sum(q.numel() for _, q in held)


def memory_child(args: argparse.Namespace) -> None:
    """One memory variant in this process; prints its result as one JSON line."""
    quantize = VARIANTS[args.variant]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    module = _build(args.memory_model, quantize, torch.bfloat16, args.r)
    built = _vm_hwm()
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    batch = _batch(module.config.vocab_size, 1, args.memory_seq_len)
    losses, seconds = [], []
    for _ in range(args.memory_steps):
        start = time.perf_counter()
        losses.append(_step(module, optimizer, batch))
        seconds.append(time.perf_counter() - start)
    packed, weights = _base_bytes(module)
    adapted = [m for m in module.modules() if hasattr(m, "lora_A")]
    base_weights = sum(m.weight.numel() for m in adapted)
    result = {
        "variant": args.variant,
        "params": sum(p.numel() for p in module.parameters() if p.dtype.is_floating_point),
        "base_weights": base_weights,
        "quantized_bytes": packed,
        "quantized_weights": weights,
        "rss_after_build": built,
        "rss_peak": _vm_hwm(),
        "losses": losses,
        "step_seconds": seconds,
        "trainable": sum(p.numel() for p in trainable),
    }
    print("RESULT " + json.dumps(result), flush=True)


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--child", variant, *_child_args(args)]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        results[variant] = json.loads(lines[-1].removeprefix("RESULT "))
    base = results["bf16 base"]
    print(
        f"memory: {args.memory_model} (random weights), LoRA r={args.r} on every attention and"
        f" MLP projection, batch 1 x {args.memory_seq_len}, bf16 weights and adapters, AdamW,"
        f" {args.memory_steps} steps, one process per variant, CPU, torch {torch.__version__}"
    )
    print()
    print(
        "| variant | base bytes MiB | bits/weight | RSS after build MiB | vs bf16"
        " | RSS peak MiB | vs bf16 | losses |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        base_bytes = r["quantized_bytes"] or 2 * r["base_weights"]
        bits = 8 * base_bytes / r["base_weights"]
        label = f"{name} (baseline)" if name == "bf16 base" else name
        print(
            f"| {label} | {base_bytes / MiB:.1f} | {bits:.4f}"
            f" | {r['rss_after_build'] / MiB:.0f}"
            f" | {r['rss_after_build'] / base['rss_after_build']:.3f}"
            f" | {r['rss_peak'] / MiB:.0f} | {r['rss_peak'] / base['rss_peak']:.3f}"
            f" | {', '.join(f'{x:.4f}' for x in r['losses'])} |"
        )
    nf4 = results["nf4"]
    bits = 8 * nf4["quantized_bytes"] / nf4["quantized_weights"]
    off = 100 * (bits / 4.127 - 1)
    print(f"\nnf4 base: {bits:.4f} bits per weight ({off:+.2f}% against 4.127)")
    return results


def _child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--memory-model", args.memory_model, "--memory-seq-len", str(args.memory_seq_len),
        "--memory-steps", str(args.memory_steps), "--r", str(args.r),
    ]  # fmt: skip


@dataclasses.dataclass
class _Speed:
    name: str
    module: CausalLM
    optimizer: torch.optim.Optimizer
    times: list[float] = dataclasses.field(default_factory=list)


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for name, quantize in SPEED_VARIANTS.items():
        module = _build(args.speed_model, quantize, torch.float32, args.r)
        trainable = [p for p in module.parameters() if p.requires_grad]
        runs.append(_Speed(name, module, torch.optim.AdamW(trainable, lr=1e-4)))
    batch = _batch(runs[0].module.config.vocab_size, args.batch_size, args.seq_len)
    for run in runs:  # warm-up (AdamW's state), then one step measured for memory
        _step(run.module, run.optimizer, batch)
    peaks, losses = {}, {}
    for run in runs:
        with LiveTensorMemory() as memory:
            memory.track(*run.module.parameters(), *run.module.buffers(), *batch)
            memory.track(*(v for s in run.optimizer.state.values() for v in s.values()))
            losses[run.name] = _step(run.module, run.optimizer, batch)
        peaks[run.name] = memory.peak_bytes
    for round_ in range(args.steps):
        shift = round_ % len(runs)
        for run in runs[shift:] + runs[:shift]:
            start = time.perf_counter()
            _step(run.module, run.optimizer, batch)
            run.times.append(time.perf_counter() - start)
    tokens = args.batch_size * args.seq_len
    results = {
        run.name: {
            "tokens_per_s": tokens / statistics.median(run.times),
            "step_seconds": run.times,
            "peak_bytes": peaks[run.name],
            "loss": losses[run.name],
        }
        for run in runs
    }
    base = results["lora"]
    print(
        f"speed: {args.speed_model}, LoRA r={args.r} on every attention and MLP projection,"
        f" batch {args.batch_size} x {args.seq_len}, fp32, {torch.get_num_threads()} threads,"
        f" median of {args.steps} interleaved steps, torch {torch.__version__}"
    )
    print()
    print("| variant | tokens/s | vs lora | step live peak MiB | vs lora | step s min-max |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        label = f"{name} (baseline)" if name == "lora" else name
        print(
            f"| {label} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f}"
            f" | {r['peak_bytes'] / MiB:.1f} | {r['peak_bytes'] / base['peak_bytes']:.3f}"
            f" | {min(r['step_seconds']):.2f}-{max(r['step_seconds']):.2f} |"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("memory", "speed", "all"), default="all")
    parser.add_argument("--memory-model", default="llama3.2-1b")
    parser.add_argument("--memory-seq-len", type=int, default=512)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--speed-model", default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per speed variant")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.variant = args.child
        memory_child(args)
        return
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    results = {}
    if args.part in ("memory", "all"):
        results["memory"] = run_memory(args)
        print()
    if args.part in ("speed", "all"):
        results["speed"] = run_speed(args)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
