"""What ``make gpu-check`` verifies on one CUDA device, as functions returning a :class:`Check`.

Everything else in this project was tested on the CPU, so the CPU is the reference:

- :func:`logits_parity`: each model family's logits on the device equal the CPU's, at fp32
  tolerance (TF32 off for the comparison);
- :func:`precision_trains`: ``bf16-mixed``, ``bf16-true`` and ``16-mixed`` steps run on the
  device and the loss falls;
- :func:`strategy_parity`: each registered strategy that fits one process
  (:attr:`~plugintrain.strategies.StrategySpec.one_process`: the data-parallel ones, and
  the hybrid and pipeline ones degenerate at world size 1) gives the losses of a plain CPU
  run, step by step;
- :func:`throughput`: ``gpt2-124m`` and ``llama3.2-1b`` (random weights) in ``bf16-mixed``:
  tokens/s, MFU against the dense bf16 peak (:mod:`plugintrain.core.peak_flops`) and peak
  memory from the CUDA allocator;
- :func:`qlora_parity`: QLoRA's ``nf4`` and ``int8`` on the device against the CPU: the
  packed bytes of one weight equal, its dequantized values equal, and a quantized LoRA
  layer's output and gradients within fp32 tolerance;
- :func:`qlora_throughput`: ``llama3.2-1b`` (random weights) with LoRA r=16 on every
  projection and an ``nf4`` base, ``bf16-mixed``: tokens/s and peak memory.

:func:`run_checks` runs the sections asked for, one report row per check.

Each function takes the device, so the same code runs on the CPU (where a comparison is
trivially equal) in the CPU test tier; ``tests/gpu`` runs them on CUDA as the ``gpu`` tier.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from plugintrain import strategies
from plugintrain.bench.recorder import BenchRecorder
from plugintrain.model_zoo import CausalLM, MNISTClassifier, TransformerConfig
from plugintrain.precision_plugins import precision_plugin_from_name
from plugintrain.strategies.registry import STRATEGIES as REGISTERED

strategies.register()  # the plugintrain strategy names, for Trainer(strategy=...)

FAMILIES = (
    "gpt2-debug",
    "llama3-debug",
    "qwen3-debug",
    "deepseek-v3-debug",
    "qwen3-moe-debug",
    "mnist",
)
PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed")
STRATEGIES = tuple(s.name for s in REGISTERED.values() if s.one_process is not None)
"""The strategies that run in one process, in registration order."""
THROUGHPUT_RUNS = {"gpt2-124m": (16, 1024), "llama3.2-1b": (4, 1024)}
"""Preset -> (sequences, tokens each) per step: benchmarks/gpu.yaml's shapes."""
QUANTIZATIONS = ("nf4", "int8")
QLORA_RUNS = {"llama3.2-1b qlora nf4": ("llama3.2-1b", 4, 1024)}
"""Name -> (preset, sequences, tokens each): the QLoRA throughput row."""
QLORA_TARGETS = ["*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo",
                 "*.feed_forward.*"]  # fmt: skip
LOGITS_TOL = 1e-4
"""Relative and absolute tolerance of fp32 logits: a few fp32 roundings per layer apart."""
LOSS_RTOL = 1e-4
"""Relative tolerance of fp32 losses over a few AdamW steps."""


@dataclass
class Check:
    """One line of the report."""

    section: str
    name: str
    ok: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)
    """Numbers for the JSON file (losses, max differences, tokens/s, ...)."""


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 (no TF32), restored afterwards: a parity
    check must compare fp32 with fp32."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def _small_config(preset: str) -> TransformerConfig:
    # The debug presets with a small vocabulary and two layers: seconds on a CPU.
    return TransformerConfig.from_name(preset, vocab_size=512, block_size=64, n_layer=2)


def _model_and_input(family: str) -> tuple[nn.Module, torch.Tensor]:
    """A seeded model of ``family`` on the CPU, in eval mode, and an input for it."""
    torch.manual_seed(0)
    if family == "mnist":
        return MNISTClassifier(arch="cnn").eval(), torch.randn(4, 1, 28, 28)
    module = CausalLM(_small_config(family))
    module.configure_model()
    return module.eval(), torch.randint(0, 512, (2, 64))


@torch.no_grad()
def logits_parity(family: str, device: torch.device) -> Check:
    """The logits of ``family`` (a debug preset, or ``mnist``'s CNN) on ``device`` against
    the same weights on the CPU."""
    model, inputs = _model_and_input(family)
    with full_fp32():
        expected = model(inputs)
        got = model.to(device)(inputs.to(device)).cpu()
    diff = (got - expected).abs().max().item()
    ok = torch.allclose(got, expected, rtol=LOGITS_TOL, atol=LOGITS_TOL)
    scale = expected.abs().max().item()
    detail = f"max |diff| {diff:.2e} (logits up to {scale:.2f}; tolerance {LOGITS_TOL:g})"
    return Check("logits", family, ok, detail, {"max_abs_diff": diff, "max_abs_logit": scale})


class _Losses(Callback):
    """The logged training loss of every step (what a pipeline logs, too)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _fit_losses(
    device: torch.device, strategy: Any, precision: str, batches: torch.Tensor, lr: float
) -> list[float]:
    """Train the small llama3-debug for one step per batch of ``batches`` ``(S, B, T+1)``
    and return the losses. The weights are drawn on the CPU first, so every device and
    strategy starts from the same ones (strategies keep a model that is already built)."""
    torch.manual_seed(0)
    optimizer = functools.partial(torch.optim.AdamW, lr=lr)
    module = CausalLM(
        _small_config("llama3-debug"), optimizer=optimizer, warmup_steps=0, lr_decay_steps=1000
    )
    module.configure_model()
    data = torch.utils.data.TensorDataset(batches[..., :-1], batches[..., 1:])
    recorder = _Losses()
    trainer = L.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        strategy=strategy,
        plugins=[precision_plugin_from_name(precision)],
        max_steps=len(batches),
        callbacks=[recorder],
        use_distributed_sampler=False,  # the same batches in the same order everywhere
        **_QUIET_TRAINER,
    )
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        if dist.is_initialized():  # world size 1: the next strategy starts its own group
            dist.destroy_process_group()
    return recorder.losses


_QUIET_TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def _token_batches(steps: int, distinct: int) -> torch.Tensor:
    """``steps`` batches ``(4, 33)`` of random tokens, cycling over ``distinct`` ones."""
    tokens = torch.randint(0, 512, (distinct, 4, 33), generator=torch.Generator().manual_seed(1))
    return tokens[torch.arange(steps) % distinct]


def precision_trains(precision: str, device: torch.device) -> Check:
    """30 steps on one repeated batch in ``precision``: the loss must fall by 20% or more
    (memorizing the batch), and stay finite."""
    losses = _fit_losses(device, "auto", precision, _token_batches(30, distinct=1), lr=3e-3)
    first, last = losses[0], statistics.fmean(losses[-3:])
    ok = all(map(math.isfinite, losses)) and last < 0.8 * first
    detail = f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps"
    return Check("precision", precision, ok, detail, {"losses": losses})


@functools.cache
def cpu_reference_losses(steps: int = 4) -> tuple[float, ...]:
    """The losses of a plain single-device fp32 CPU run (computed once)."""
    with full_fp32():
        cpu = torch.device("cpu")
        return tuple(_fit_losses(cpu, "auto", "32-true", _token_batches(steps, steps), 1e-3))


def strategy_parity(strategy: str, device: torch.device, steps: int = 4) -> Check:
    """``strategy`` at world size 1 on ``device``, fp32: the CPU reference's losses."""
    reference = cpu_reference_losses(steps)
    spec = REGISTERED[strategy]
    # By name, unless one process needs other options (a pipeline of one stage).
    chosen = spec.load()(**{**spec.options, **spec.one_process}) if spec.one_process else strategy
    with full_fp32():
        losses = _fit_losses(device, chosen, "32-true", _token_batches(steps, steps), 1e-3)
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    ok = max(diffs) <= LOSS_RTOL
    detail = f"{steps} steps, largest relative loss difference {max(diffs):.1e}"
    return Check("strategy", strategy, ok, detail, {"losses": losses, "cpu_losses": reference})


def throughput(preset: str, device: torch.device, steps: int = 10, warmup: int = 3) -> Check:
    """``preset`` with random weights, ``bf16-mixed``, AdamW: tokens/s over ``steps`` timed
    optimizer steps (after ``warmup``), MFU and peak memory, from :class:`BenchRecorder`."""
    batch, seq_len = THROUGHPUT_RUNS[preset]
    record = _recorded_run(preset, batch, seq_len, device, steps, warmup, [])
    return _throughput_check(preset, record)


def _recorded_run(
    preset: str,
    batch: int,
    seq_len: int,
    device: torch.device,
    steps: int,
    warmup: int,
    callbacks: list[Callback],
) -> dict[str, Any]:
    """Train ``preset`` (random weights, ``bf16-mixed``, AdamW) on one reused batch with
    ``callbacks``; :class:`BenchRecorder`'s record of the run."""
    config = TransformerConfig.from_name(preset, block_size=seq_len)
    fused = device.type == "cuda"  # one kernel for the whole update
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-4, fused=fused)
    module = CausalLM(config, optimizer=optimizer, warmup_steps=0, lr_decay_steps=1000)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=batch)  # one batch, reused
    with tempfile.TemporaryDirectory() as out:
        trainer = L.Trainer(
            accelerator=device.type,
            devices=1,
            plugins=[precision_plugin_from_name("bf16-mixed")],
            max_steps=warmup + steps + 1,  # BenchRecorder measures memory on one more
            callbacks=[*callbacks, BenchRecorder(out, warmup=warmup)],
            **_QUIET_TRAINER,
        )
        trainer.fit(module, loader)
        return json.loads((Path(out) / "rank0.json").read_text())


def qlora_parity(kind: str, device: torch.device) -> Check:
    """QLoRA's ``kind`` on ``device`` against the CPU, fp32: one 1024 x 512 weight's codes
    equal (NF4: the 4-bit codes; the double quantization's offset is a mean, whose fp32 sum
    may round otherwise on the device), the CPU's bytes dequantized to the same values, the
    device's own bytes within 1e-6, and a quantized LoRA layer's output and gradients within
    fp32 tolerance."""
    from plugintrain.model_zoo import quantization
    from plugintrain.model_zoo.lora import LoRASpec, init_adapters, inject

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 512, generator=generator) * 0.02
    x = torch.randn(8, 512, generator=generator)
    packed = {d: quantization.quantize(weight.to(d), kind).cpu() for d in ("cpu", device)}
    codes = 1024 * 512 // 2 if kind == "nf4" else 1024 * 512
    same_bytes = torch.equal(packed["cpu"][:codes], packed[device][:codes])
    values = {
        d: quantization.dequantize(packed["cpu"].to(d), kind, (1024, 512), torch.float32).cpu()
        for d in ("cpu", device)
    }
    own = quantization.dequantize(packed[device], kind, (1024, 512), torch.float32)
    same_values = torch.equal(values["cpu"], values[device]) and torch.allclose(
        own, values["cpu"], rtol=1e-6, atol=0
    )
    results = {}
    with full_fp32():
        for d in ("cpu", device):
            layer = nn.Sequential(nn.Linear(512, 1024, bias=False))
            layer[0].weight.data.copy_(weight)
            inject(layer, LoRASpec(r=8, target_modules=("0",), quantize=kind))
            init_adapters(layer, seed=0)
            layer[0].lora_B.data.normal_(generator=torch.Generator().manual_seed(1))
            layer.to(d)
            xd = x.to(d).requires_grad_(True)
            out = layer(xd)
            out.square().sum().backward()
            results[d] = (out.cpu(), xd.grad.cpu(), layer[0].lora_A.grad.cpu())
    diffs = [float((a - b).abs().max()) for a, b in zip(*results.values(), strict=True)]
    close = all(
        torch.allclose(a, b, rtol=LOGITS_TOL, atol=LOGITS_TOL)
        for a, b in zip(*results.values(), strict=True)
    )
    ok = same_bytes and same_values and close
    detail = (
        f"codes {'equal' if same_bytes else 'DIFFER'}, dequantized"
        f" {'equal' if same_values else 'DIFFER'}, layer output/grads max diff {max(diffs):.1e}"
    )
    return Check("qlora", kind, ok, detail, {"diffs": diffs})


def qlora_throughput(name: str, device: torch.device, steps: int = 10, warmup: int = 3) -> Check:
    """:data:`QLORA_RUNS` ``name``: random weights, LoRA r=16 on every projection with an
    ``nf4`` base, ``bf16-mixed``, AdamW on the adapters: tokens/s and peak memory."""
    from plugintrain.callbacks import LoRA

    preset, batch, seq_len = QLORA_RUNS[name]
    lora = LoRA(r=16, alpha=32, target_modules=QLORA_TARGETS, quantize="nf4")
    record = _recorded_run(preset, batch, seq_len, device, steps, warmup, [lora])
    check = _throughput_check(name, record)
    check.section, check.name = "qlora", name
    return check


def _throughput_check(preset: str, record: dict[str, Any]) -> Check:
    seconds = statistics.median(record["step_seconds"])
    tokens_per_s = record["tokens_per_step"] / seconds
    peak = record["peak_flops"]
    mfu = None if peak is None else record["flops_per_token"] * tokens_per_s / peak
    figures = {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_bytes": record["peak_bytes"],
        "step_seconds": record["step_seconds"],
        "device": record["device"],
        "loss": record["loss"],
    }
    mfu_text = "unknown peak" if mfu is None else f"{100 * mfu:.1f}%"
    detail = (
        f"{tokens_per_s:,.0f} tokens/s, MFU {mfu_text},"
        f" peak memory {record['peak_bytes'] / 2**30:.1f} GiB"
    )
    return Check("throughput", f"{preset} bf16-mixed", True, detail, figures)


def quiet() -> None:
    """Lightning's per-run banners and hints would drown the table."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")


def planned_checks(
    device: torch.device, sections: Sequence[str]
) -> list[tuple[str, str, Callable]]:
    """(section, name, check) triples to run on ``device``, in report order."""
    plan = {
        "logits": (FAMILIES, logits_parity),
        "precision": (PRECISIONS, precision_trains),
        "strategy": (STRATEGIES, strategy_parity),
        "throughput": (tuple(THROUGHPUT_RUNS), throughput),
        "qlora": (QUANTIZATIONS, qlora_parity),
        "qlora_throughput": (tuple(QLORA_RUNS), qlora_throughput),
    }
    return [
        (section, name, functools.partial(plan[section][1], name, device))
        for section in sections
        for name in plan[section][0]
    ]


def run_checks(device: torch.device, sections: Sequence[str]) -> list[dict]:
    """Run the planned checks; one that raises is a failed check naming its exception
    (the rest still run), with the traceback on stderr."""
    quiet()
    rows = []
    for section, name, check in planned_checks(device, sections):
        start = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # report it and go on: one table of every result
            traceback.print_exc()
            result = Check(section, name, False, f"{type(error).__name__}: {error}")
        rows.append({**asdict(result), "seconds": time.perf_counter() - start})
        print(_row(rows[-1]), flush=True)
    return rows


def _row(row: dict) -> str:
    verdict = "ok" if row["ok"] else "FAIL"
    return (
        f"{row['section']:<11} {row['name']:<24} {verdict:<5}"
        f" {row['seconds']:>6.1f}s  {row['detail']}"
    )
