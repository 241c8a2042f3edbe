"""Packed rows attending within their documents, against the dense ``T x T`` mask (the
baseline, ``packed_attention: dense``), one command::

    .venv/bin/python benchmarks/packed_attention.py [--rounds 3] [--steps 3] [--warmup 1]
        [--seq 8192] [--chat-steps 2] [--skip-chat] [--json PATH]

**Speed** (issue 46: at least 1.5x the tokens/s at T = 8,192 on CPU, the same losses
within 1e-5): llama3-debug (4 layers, 4 query and 2 key/value heads of 32 channels) with
its vocabulary cut to 8,192 and ``block_size`` the row length, so that attention, not the
128k-entry head, is what differs; one packed row of ``--seq`` tokens a step, documents of
64 to 1,024 tokens (seeded), every token a target; AdamW, fp32, in this process. Each round
trains both paths from the same weights, alternating which goes first; reported: median
tokens/s over rounds (the steps after ``--warmup``), the ratio, and the largest relative
difference between the two paths' losses over every step.

**Memory** (issue 46: ``prepare chat``'s default 2,048-token rows with the shipped chat
LoRA recipe at batch 2 peak at 12.9 GiB of RSS on CPU; at most 3 GiB, the same losses):
``plugintrain fit --config recipes/smollm2_lora_chat_cpu.yaml`` on the dates set prepared
with ``plugintrain prepare chat`` at its defaults (2,048-token rows), ``--chat-steps`` steps,
no validation, each run in a fresh process (its checkpoints in a temporary folder): the
recipe as it shipped before (one device, the logits whole; with the dense mask, the
baseline, and with documents), as it ships now, and as it ships without
``ReleaseFreedMemory`` (:data:`RECIPE_VARIANTS`); reported:
the process's peak RSS (``wait4``'s ``ru_maxrss``), its time, and the largest relative
difference of its logged losses from the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
PATHS = ("dense", "documents")
DATA = REPO / "data" / "dates_chat_2048"


# ---------------------------------------------------------------- speed


def _lengths(seq: int, generator: torch.Generator) -> list[int]:
    """Document lengths filling a row of ``seq`` tokens (64 to 1,024 each)."""
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(64, 1025, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - seq
    return [n for n in lengths if n > 0]


def _train(path: str, seq: int, steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` AdamW steps of one packed row on llama3-debug (vocab 8,192) under ``path``."""
    from plugintrain.model_zoo import Transformer, TransformerConfig

    config = TransformerConfig.from_name("llama3-debug", vocab_size=8192, block_size=seq)
    torch.manual_seed(0)
    model = Transformer(config)
    model.packed_attention = path
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(warmup + steps):
        lengths = _lengths(seq, generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        tokens = torch.randint(0, config.vocab_size, (1, seq + 1), generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1], positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    return {"losses": losses, "tokens_per_s": seq * steps / sum(times[warmup:])}


def speed(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for round_ in range(args.rounds):
        for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
            result = _train(path, args.seq, args.steps, args.warmup)
            runs[path].append(result)
            print(
                f"round {round_ + 1}: {path:<9} {result['tokens_per_s']:8.1f} tokens/s", flush=True
            )
    medians = {path: statistics.median(r["tokens_per_s"] for r in runs[path]) for path in PATHS}
    worst = max(
        abs(a - b) / abs(b)
        for dense, docs in zip(runs["dense"], runs["documents"], strict=True)
        for a, b in zip(docs["losses"], dense["losses"], strict=True)
    )
    return {
        "tokens_per_s": medians,
        "ratio": medians["documents"] / medians["dense"],
        "loss_rel_diff": worst,
        "runs": runs,
    }


# ---------------------------------------------------------------- memory of the chat recipe


def _chat_data() -> Path:
    """The dates set as ``prepare chat`` writes it at its defaults (2,048-token rows)."""
    if (DATA / "meta.json").is_file():
        return DATA
    plugintrain = [sys.executable, "-m", "plugintrain"]
    rows = DATA.with_suffix(".jsonl")
    subprocess.run([*plugintrain, "prepare", "dates", "--out", str(rows)], check=True)
    subprocess.run(
        [
            *plugintrain,
            "prepare",
            "chat",
            str(rows),
            "--tokenizer",
            "smollm2-135m",
            "--out",
            str(DATA),
            "--val_examples",
            "100",
        ],
        check=True,
    )
    return DATA


RECIPE_VARIANTS = {
    # The recipe as it shipped before issue 46: one device, logits whole, dense mask.
    "dense, whole logits": (
        "--model.init_args.packed_attention=dense",
        "--trainer.strategy=auto",
        "--model.init_args.fused_head_loss=false",
    ),
    "documents, whole logits": (
        "--trainer.strategy=auto",
        "--model.init_args.fused_head_loss=false",
    ),
    # Documents, full recomputation, the head fused with the loss; glibc's heap as it is.
    "recomputation, fused head": (),
    # The shipped recipe: the same, freed activations of 8 MiB or more returned to the system.
    "shipped recipe": (),
}
"""Each chat-recipe run of :func:`memory`: its name -> the overrides of the shipped recipe."""
RELEASING = {"shipped recipe"}
"""The variants that keep the recipe's ``ReleaseFreedMemory`` callback; the others run the
recipe without it (written to a temporary copy)."""


def _recipe(variant: str, work: Path) -> Path:
    """The shipped chat recipe, without ``ReleaseFreedMemory`` unless ``variant`` keeps it."""
    import yaml

    shipped = REPO / "recipes" / "smollm2_lora_chat_cpu.yaml"
    if variant in RELEASING:
        return shipped
    recipe = yaml.safe_load(shipped.read_text())
    callbacks = recipe["trainer"]["callbacks"]
    recipe["trainer"]["callbacks"] = [
        c for c in callbacks if "ReleaseFreedMemory" not in c["class_path"]
    ]
    copy = work / f"{variant.replace(' ', '_').replace(',', '')}.yaml"
    copy.write_text(yaml.safe_dump(recipe))
    return copy


def _fit(variant: str, steps: int, work: Path) -> dict[str, Any]:
    """The chat recipe fitted ``steps`` steps as ``variant`` in a fresh process."""
    out = work / variant.replace(" ", "_").replace(",", "")
    command = [
        sys.executable,
        "-m",
        "plugintrain",
        "fit",
        "--config",
        str(_recipe(variant, work)),
        f"--data.init_args.data_dir={_chat_data()}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.default_root_dir={out}",
        *RECIPE_VARIANTS[variant],
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{variant}: plugintrain fit exited with {proc.returncode}")
    return {
        "rss_peak_gib": usage.ru_maxrss * 1024 / 2**30,
        "seconds": time.perf_counter() - started,
        "losses": _losses(out),
    }


def _losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = {p.parent for p in out.rglob("events.out.tfevents*")}
    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.value for e in events.Scalars("train_loss")]


def memory(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        runs = {name: _fit(name, args.chat_steps, Path(work)) for name in RECIPE_VARIANTS}
    for name, run in runs.items():
        print(f"chat recipe, {name:<24} peak RSS {run['rss_peak_gib']:.2f} GiB", flush=True)
    baseline = runs["dense, whole logits"]["losses"]
    worst = max(
        abs(a - b) / abs(b)
        for run in runs.values()
        for a, b in zip(run["losses"], baseline, strict=True)
    )
    return {"runs": runs, "loss_rel_diff": worst}


# ---------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--chat-steps", type=int, default=2)
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--skip-speed", action="store_true", help="the chat recipe's runs only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print("$", " ".join(sys.argv), flush=True)
    results: dict[str, Any] = {} if args.skip_speed else {"speed": speed(args)}
    if not args.skip_chat:
        results["memory"] = memory(args)
    if "speed" in results:
        s = results["speed"]
        print(f"\nspeed, T={args.seq}, {torch.get_num_threads()} threads, median of {args.rounds}:")
        for path in PATHS:
            print(f"  {path:<9} {s['tokens_per_s'][path]:8.1f} tokens/s")
        print(f"  documents / dense: {s['ratio']:.2f}x; losses within {s['loss_rel_diff']:.1e}")
    if "memory" in results:
        m = results["memory"]
        print(f"\nchat recipe at 2,048-token rows, batch 2, {args.chat_steps} steps:")
        for name, run in m["runs"].items():
            print(f"  {name:<24} peak RSS {run['rss_peak_gib']:.2f} GiB, {run['seconds']:.0f} s")
        print(f"  losses within {m['loss_rel_diff']:.1e}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
