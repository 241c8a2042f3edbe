"""LoRA fine-tuning against full fine-tuning (the baseline) of the same model, in one command::

    .venv/bin/python benchmarks/lora.py [--model llama3-debug] [--batch-size 4] [--seq-len 64]
        [--steps 5] [--warmup 1] [--r 8] [--targets GLOB ...] [--device cpu|cuda]
        [--precision 32-true|bf16-mixed] [--no-bf16-base] [--json PATH]

Three variants of one model (same seed, same random batch), each trained with plain
PyTorch steps (``loss_fn(module(x), y).backward(); AdamW.step(); zero_grad()``):

* ``full`` (baseline): every parameter trains.
* ``lora r=8``: :func:`plugintrain.model_zoo.lora.inject` puts rank-``r`` adapters (``alpha = 2r``)
  on every attention projection and feed-forward Linear layer (``*.attention.wq|wk|wv|wo``,
  ``*.feed_forward.*``; ``--targets`` changes them); everything else is frozen, the tied
  embedding and head included.
* ``lora r=8, bf16 base`` (``--no-bf16-base`` leaves it out): the same, the adapted
  layers' frozen weights stored in bf16 (``LoRASpec(base_dtype="bf16")``), the adapters
  trained in fp32.

For each: trainable parameters; optimizer-state bytes (every tensor in ``optimizer.state``
after the warm-up steps); "static" bytes, those live before a step (weights, buffers,
optimizer state, the batch); the peak bytes of one steady-state training step, forward to
``zero_grad`` (CPU: :class:`plugintrain.core.memory.LiveTensorMemory`, which sees every tensor
an operator allocates, and names the operator that set the peak; CUDA: the allocator's
peak, less what the other variants keep resident); and tokens/s, the median of ``--steps``
timed steps (their min-max shown) after ``--warmup`` untimed steps and the measured one,
the variants' steps interleaved round by round so that a change of load on the machine hits
them alike. Ratios are to ``full``. Sanity lines follow: the optimizer-state ratio expected
from the parameter counts (AdamW keeps two moments in the parameter's dtype, fp32 here,
plus a 4-byte step counter per tensor) beside the measured one, and the peak ratio split
into static and transient bytes. Nothing here asserts on time.

``--model`` is a preset (``TransformerConfig.presets()``, random init; e.g.
``--model llama3.2-1b --device cuda`` on a GPU) or a pretrained name (``smollm2-135m``,
read from its cached file). ``--precision bf16-mixed`` runs forward and loss under bf16
autocast (on a CPU without bf16 arithmetic, AVX2 here, bf16 work is emulated and slow,
which is also why the ``bf16 base`` variant is slower on this CPU).

Measured on this machine (2 CPU cores, AVX2, torch 2.13.0+cpu), default arguments, 21 s
(31 s with the imports; 75 s while other jobs loaded the cores, when the tokens/s varied
2x from run to run; the bytes do not vary). llama3-debug, 17.2 M parameters of which 16.4 M
are the tied 128,256 x 128 embedding/head, B=4 T=64, fp32::

    variant               trainable  opt. state MiB    step peak MiB   tokens/s
    full (baseline)      17,204,352  131.26            583.6           246
    lora r=8                 77,824    0.59 (0.0045x)  452.2 (0.77x)   393 (1.59x)
    lora r=8, bf16 base      77,824    0.59 (0.0045x)  450.7 (0.77x)   283 (1.15x)

The optimizer-state ratio is the expected one (0.00453 measured and expected). The peak
falls only to 0.77x: static bytes fall from 197.0 to 66.6 MiB (131 MiB of AdamW state
gone), but the transient part is the same, about 386 MiB in both, as the peak is in the
log-softmax backward of the 128,256-token head, where three 125 MiB fp32 logits tensors
are alive and no weight gradient exists yet; so LoRA's saving on gradients does not show,
and storing the adapted layers in bf16 saves 1.5 MiB (they hold 0.79 M of the 17.2 M
parameters). With a model whose body outweighs its head,
``--model smollm2-135m --batch-size 1 --seq-len 64 --steps 3 --warmup 1`` (pretrained,
134.5 M parameters, 82 s, idle)::

    variant               trainable   opt. state MiB    step peak MiB    tokens/s
    full (baseline)      134,515,008  1026.27           2272.5           34
    lora r=8               2,442,240    18.63 (0.0182x)  659.2 (0.29x)   59 (1.72x)
    lora r=8, bf16 base    2,442,240    18.63 (0.0182x)  456.7 (0.20x)    6 (0.18x)

There full fine-tuning peaks when autograd adds the tied embedding's two gradients at the
end of the backward (and again, to the byte, in AdamW's update of the embedding): all
513 MiB of gradients live plus two 108 MiB embedding-sized temporaries, 729 MiB transient
against LoRA's 114.2 MiB; and the bf16 base saves another 202.5 MiB of weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plugintrain.core.memory import LiveTensorMemory
from plugintrain.data.assets import PRETRAINED_MODELS
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.model_zoo.lora import LoRASpec, init_adapters, inject

TARGETS = (
    "*.attention.wq",
    "*.attention.wk",
    "*.attention.wv",
    "*.attention.wo",
    "*.feed_forward.*",
)
BASELINE = "full"
PRECISIONS = ("32-true", "bf16-mixed")
LR = 1e-4
MiB = 2**20


@dataclasses.dataclass
class Variant:
    """One way of fine-tuning the model, and what was measured of it."""

    name: str
    spec: LoRASpec | None
    module: CausalLM | None = None
    optimizer: torch.optim.Optimizer | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    result: dict[str, Any] = dataclasses.field(default_factory=dict)


def _variants(args: argparse.Namespace) -> list[Variant]:
    spec = LoRASpec(r=args.r, alpha=2.0 * args.r, target_modules=tuple(args.targets))
    variants = [Variant(BASELINE, None), Variant(f"lora r={args.r}", spec)]
    if args.bf16_base:
        variants.append(
            Variant(f"lora r={args.r}, bf16 base", dataclasses.replace(spec, base_dtype="bf16"))
        )
    return variants


def _build(variant: Variant, args: argparse.Namespace, device: torch.device) -> None:
    """The model (seed 0: every variant starts from the same weights), adapters injected
    for LoRA, and AdamW over the parameters that require gradients."""
    torch.manual_seed(0)
    if args.model in PRETRAINED_MODELS:
        module = CausalLM(weights=args.model)
    else:
        module = CausalLM(args.model)
    with torch.device(device):
        module.configure_model()
    module.to(device)
    if variant.spec is not None:
        inject(module, variant.spec)
        init_adapters(module, seed=0)
    module.train()
    variant.module = module
    trainable = [p for p in module.parameters() if p.requires_grad]
    variant.optimizer = torch.optim.AdamW(trainable, lr=LR)


def _step_fn(
    variant: Variant, batch: tuple[Tensor, Tensor], args: argparse.Namespace
) -> Callable[[], None]:
    module, optimizer = variant.module, variant.optimizer
    assert module is not None and optimizer is not None
    x, y = batch
    autocast = torch.autocast(
        x.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"
    )

    def step() -> None:
        with autocast:
            loss = module.loss_fn(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _storage_bytes(tensors: Iterable[Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` on ``device``'s type (tied weights and
    views count once), as :class:`LiveTensorMemory` and the allocator count them."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type == device.type:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _PeakSite(LiveTensorMemory):
    """:class:`LiveTensorMemory` that also notes the operator at which the peak was set."""

    site = "?"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        peak = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak_bytes > peak:
            self.site = str(func)
        return out


def _memory(
    variant: Variant, step: Callable[[], None], batch: tuple[Tensor, Tensor], device: torch.device
) -> tuple[int, int, str | None]:
    """(bytes live before a step, peak bytes during it, the operator at the peak) of this
    variant's tensors.

    CPU: a :class:`LiveTensorMemory` that tracks the variant's weights, buffers, optimizer
    state and batch, and sees all the step allocates (the other variants' models are
    neither tracked nor touched). CUDA: the allocator's peak over the step, less what
    was allocated before it but is not this variant's (the other models stay resident);
    no operator is named.
    """
    module, optimizer = variant.module, variant.optimizer
    assert module is not None and optimizer is not None
    existing = [
        *module.parameters(),
        *module.buffers(),
        *_state_tensors(optimizer),
        *batch,
    ]
    static = _storage_bytes(existing, device)
    if device.type == "cuda":
        _sync(device)
        others = torch.cuda.memory_allocated(device) - static
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return static, torch.cuda.max_memory_allocated(device) - others, None
    with _PeakSite(device.type) as memory:
        memory.track(existing)
        static = memory.live_bytes
        step()
    return static, memory.peak_bytes, memory.site


def _run(args: argparse.Namespace) -> tuple[list[Variant], dict[str, Any]]:
    device = torch.device(args.device)
    variants = _variants(args)
    for variant in variants:
        _build(variant, args, device)
    config: TransformerConfig = variants[0].module.config  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator
    ).to(device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    steps = {v.name: _step_fn(v, batch, args) for v in variants}
    # Warm-up: first-call overheads, and AdamW creates its state on the first step.
    for _ in range(args.warmup):
        for variant in variants:
            steps[variant.name]()
    for variant in variants:
        static, peak, site = _memory(variant, steps[variant.name], batch, device)
        assert variant.module is not None and variant.optimizer is not None
        params = list(variant.module.parameters())
        trainable = [p for p in params if p.requires_grad]
        state = _state_tensors(variant.optimizer)
        variant.result = {
            "trainable_params": sum(p.numel() for p in trainable),
            "total_params": sum(p.numel() for p in params),
            "trainable_tensors": len(trainable),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
            "expected_state_bytes": sum(2 * p.numel() * p.element_size() + 4 for p in trainable),
            "static_bytes": static,
            "peak_bytes": peak,
            "peak_op": site,
        }
    # Timed rounds: one step of every variant per round, the order rotated each round.
    for round_ in range(args.steps):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.times.append(_timed(steps[variant.name], device))
    tokens_per_step = args.batch_size * args.seq_len
    for variant in variants:
        seconds = statistics.median(variant.times)
        variant.result["step_seconds_median"] = seconds
        variant.result["step_seconds"] = variant.times
        variant.result["tokens_per_s"] = tokens_per_step / seconds
    info = {
        "model": args.model,
        "config": config.name,
        "vocab_size": config.vocab_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "device": str(device),
        "precision": args.precision,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "warmup": args.warmup,
        "steps": args.steps,
        "baseline": BASELINE,
    }
    return variants, info


def _report(variants: list[Variant], info: dict[str, Any]) -> str:
    base = variants[0].result
    device_name = (
        torch.cuda.get_device_name(info["device"])
        if info["device"].startswith("cuda")
        else f"CPU {torch.backends.cpu.get_cpu_capability()}, {info['threads']} threads"
    )
    lines = [
        f"{info['model']}: {base['total_params'] / 1e6:.1f} M params (vocab {info['vocab_size']},"
        f" n_embd {info['n_embd']}, {info['n_layer']} layers), B={info['batch_size']}"
        f" T={info['seq_len']}, {info['precision']}, {device_name}, torch {info['torch']};"
        f" tokens/s: median of {info['steps']} steps after {info['warmup']} warm-up + 1 measured",
        "",
        "| variant | trainable params | % of params | optimizer state MiB | vs full"
        " | static MiB | step peak MiB | vs full | tokens/s | vs full | step s min-max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in variants:
        r = variant.result
        name = f"{variant.name} (baseline)" if variant.name == BASELINE else variant.name
        lines.append(
            f"| {name} | {r['trainable_params']:,}"
            f" | {100 * r['trainable_params'] / r['total_params']:.2f}"
            f" | {_mib(r['optimizer_state_bytes'], 2)}"
            f" | {_ratio(r, base, 'optimizer_state_bytes', 4)}x"
            f" | {_mib(r['static_bytes'])} | {_mib(r['peak_bytes'])}"
            f" | {_ratio(r, base, 'peak_bytes')}x"
            f" | {r['tokens_per_s']:.0f} | {_ratio(r, base, 'tokens_per_s')}x"
            f" | {min(r['step_seconds']):.2f}-{max(r['step_seconds']):.2f} |"
        )
    for variant in variants[1:]:
        r = variant.result
        transient, base_transient = (x["peak_bytes"] - x["static_bytes"] for x in (r, base))
        lines += [
            "",
            f"sanity, {variant.name} vs full:",
            f"  optimizer state: measured {_ratio(r, base, 'optimizer_state_bytes', 5)}"
            f" ({r['optimizer_state_bytes']:,} / {base['optimizer_state_bytes']:,} B), expected"
            f" {_ratio(r, base, 'expected_state_bytes', 5)} (2 AdamW moments in the parameter's"
            " dtype per trainable parameter + a 4 B step per tensor; parameters alone"
            f" {_ratio(r, base, 'trainable_params', 5)})",
            f"  step peak: {_ratio(r, base, 'peak_bytes', 3)} = (static {_mib(r['static_bytes'])}"
            f" + transient {_mib(transient)}) / ({_mib(base['static_bytes'])}"
            f" + {_mib(base_transient)}) MiB",
        ]
        if r["peak_op"] is not None:
            lines.append(f"  peak reached in {r['peak_op']} (full: in {base['peak_op']})")
    logits = info["batch_size"] * info["seq_len"] * info["vocab_size"] * 4
    lines += ["", f"for scale: one fp32 logits tensor (B x T x vocab) is {_mib(logits)} MiB"]
    return "\n".join(lines)


def _ratio(r: dict[str, Any], base: dict[str, Any], key: str, digits: int = 2) -> str:
    return f"{r[key] / base[key]:.{digits}f}"


def _mib(n: int, digits: int = 1) -> str:
    return f"{n / MiB:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="llama3-debug",
        help=f"a preset (random init: {', '.join(TransformerConfig.presets())}) or a"
        f" pretrained name ({', '.join(PRETRAINED_MODELS)})",
    )
    parser.add_argument("--batch-size", "--batch_size", type=int, default=4)
    parser.add_argument("--seq-len", "--seq_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per variant before the measured one"
    )
    parser.add_argument("--r", type=int, default=8, help="LoRA rank (alpha = 2r)")
    parser.add_argument(
        "--targets", nargs="+", default=list(TARGETS), help="globs of the Linear layers to adapt"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument(
        "--no-bf16-base",
        dest="bf16_base",
        action="store_false",
        help="leave out the LoRA variant with bf16 frozen weights",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (AdamW creates its state on the first step)")
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    variants, info = _run(args)
    print(_report(variants, info))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        payload = {**info, "results": {v.name: v.result for v in variants}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
