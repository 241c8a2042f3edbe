"""DPO's memory against supervised fine-tuning's at the same tokens per step, one command::

    .venv/bin/python benchmarks/dpo_memory.py [--rounds 1] [--steps 1] [--warmup 1]
        [--pad-multiple 64] [--json PATH]

Issue 45's bars: LoRA-DPO's peak resident memory at most 1.1x LoRA-SFT's, and full DPO's
with cached reference log-probs at most 1.1x full SFT's, at the same tokens per step.

The model is SmolLM2-135M-Instruct in fp32 on the CPU, from the Hugging Face directory
``benchmarks/dpo_vs_trl.py`` builds; the data the dates demo's pairs, prepared as that
benchmark prepares them and, once more, with the base's reference log-probs (``plugintrain
prepare preference --reference``). Every measurement reads the same batches: the first
``--warmup + 1 + --steps`` of ``PreferenceDataModule`` over that folder in file order (4
pairs: 8 rows, padded to a multiple of ``--pad-multiple``), through ``lightning.Trainer.fit``
as ``plugintrain fit`` runs a CPU recipe (no logger, checkpoints, validation or clipping),
AdamW (lr 1e-3, betas 0.9/0.999, no weight decay):

* ``lora_dpo``: :class:`plugintrain.model_zoo.PreferenceLM` (sigmoid, beta 0.1) with the
  :class:`plugintrain.callbacks.LoRA` callback (r=16, alpha=32, dropout 0, all seven
  projections), the reference being the base with the adapters off (one more no-grad
  forward a step), as ``recipes/smollm2_dpo_cpu.yaml`` trains;
* ``lora_sft``: :class:`plugintrain.model_zoo.CausalLM` with the same adapters on the same
  rows as an SFT batch: the 8 rows, their answer tokens the targets;
* ``full_dpo``: PreferenceLM without adapters, the reference log-probs the folder's
  (``reference: data``): one copy of the weights;
* ``full_sft``: CausalLM without adapters on the same rows as ``lora_sft``;
* ``full_dpo_pass``: ``full_dpo`` with the reference from ``fit``'s own first pass over
  the pairs (``reference: first_pass``, cached in a fresh folder each run), whose no-grad
  forwards count toward the training peak.

``--kinds`` measures some of them (default: all five).

Each measurement runs in a fresh process (``--rounds`` rounds, the order reversed every
other round); reported per measurement (medians over rounds): the peak resident memory of
the training steps (VmHWM, reset once the model is loaded, so the optimizer state that the
first step allocates counts), the resident memory once loaded, and the peak live tensor
bytes of step ``--warmup`` (:class:`plugintrain.core.memory.LiveTensorMemory`: weights,
gradients, optimizer state and everything the step allocates); then DPO / SFT for each.
A fingerprint of the batches (their shapes and summed ids) shows that all four read the
same ones. (The SFT losses are the summed loss of the answer tokens over all 8 x T
positions: no data module tells CausalLM that the targets are masked; memory is the same.)

Results, 2026-12-06, default arguments, about 12 minutes, with other jobs on the 2 cores
(load average 5 to 6.6; memory figures move little with load)::

    .venv/bin/python benchmarks/dpo_memory.py

    measurement   training RSS peak MiB   RSS once loaded MiB   step live peak MiB
    lora_dpo      3912                    1578                  2184
    lora_sft      3846                    1578                  2169
    full_dpo      5425                    1544                  3578
    full_sft      5464                    1544                  3754

LoRA-DPO / LoRA-SFT: 1.017x training RSS peak (bar 1.1x), 1.007x step live peak; full DPO
with the folder's reference log-probs / full SFT: 0.993x and 0.953x (bar 1.1x); batches 8 x
128, the same in all four. The reference's no-grad forward adds almost nothing to the LoRA
run's peak, which backward reaches.

The first pass, 2026-12-07, idle, 219 s::

    .venv/bin/python benchmarks/dpo_memory.py --kinds full_dpo_pass full_sft full_dpo

    measurement     training RSS peak MiB   RSS once loaded MiB   step live peak MiB
    full_dpo_pass   5357                    1582                  3578
    full_sft        5424                    1520                  3754
    full_dpo        5444                    1520                  3578

full_dpo_pass / full_sft: 0.988x training RSS peak, 0.953x step live peak (full_dpo /
full_sft in the same command: 1.004x); the first losses log 2 (0.6931).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from dpo_vs_trl import (
    ALPHA,
    BETA,
    PAIRS,
    SEED,
    R,
    adamw,
    cache_dir,
    cpu_trainer,
    ensure_assets,
    fit_batches,
)
from lora_vs_litgpt import RESULT, TARGETS, _initial_adapters, _PluginTrainSteps, alternate

KINDS = ("lora_dpo", "lora_sft", "full_dpo", "full_sft", "full_dpo_pass")
PAIRS_OF_KINDS = (("lora_dpo", "lora_sft"), ("full_dpo", "full_sft"), ("full_dpo_pass", "full_sft"))
BAR = 1.1
MiB = 2**20


# ---------------------------------------------------------------- parent


def _worker_command(kind: str, work: Path, assets: dict[str, Path], args: argparse.Namespace):
    return [
        *(sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--work", str(work)),
        *("--weights", str(assets["hf"]), "--data", str(assets["data"])),
        *("--warmup", str(args.warmup), "--steps", str(args.steps)),
        *("--pad-multiple", str(args.pad_multiple)),
    ]


def _peak(name: str, result: dict[str, Any]) -> str:
    return f"{name:<9} training RSS peak {result['rss_peak_bytes'] / MiB:6.0f} MiB"


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rss_peak_mib": statistics.median(run["rss_peak_bytes"] for run in runs) / MiB,
        "rss_peak_mib_runs": [run["rss_peak_bytes"] / MiB for run in runs],
        "rss_loaded_mib": statistics.median(run["rss_loaded_bytes"] for run in runs) / MiB,
        "step_peak_mib": statistics.median(run["step_peak_bytes"] for run in runs) / MiB,
        "trainable": runs[0]["trainable"],
        "losses": runs[0]["losses"],
        "batches": runs[0]["batches"],
    }


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    kinds = list(results)
    x_shape = results[kinds[0]]["batches"][0][0]
    lines = [
        f"SmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads), {PAIRS} pairs"
        f" a step (batches {x_shape[0]} x {x_shape[1]}), {args.rounds} run(s) each, a run"
        f" {args.warmup} warm-up + 1 memory step + {args.steps} more",
        "",
        "| measurement | training RSS peak MiB | per-run | RSS once loaded MiB"
        " | step live peak MiB | trainable | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in kinds:
        r = results[kind]
        runs = ", ".join(f"{m:.0f}" for m in r["rss_peak_mib_runs"])
        lines.append(
            f"| {kind} | {r['rss_peak_mib']:.0f} | {runs} | {r['rss_loaded_mib']:.0f}"
            f" | {r['step_peak_mib']:.0f} | {r['trainable']:,} | {r['losses'][0]:.4f} |"
        )
    lines.append("")
    for dpo, sft in PAIRS_OF_KINDS:
        if dpo not in results or sft not in results:
            continue
        rss = results[dpo]["rss_peak_mib"] / results[sft]["rss_peak_mib"]
        live = results[dpo]["step_peak_mib"] / results[sft]["step_peak_mib"]
        verdict = "within" if rss <= BAR else "OVER"
        lines.append(
            f"{dpo} / {sft}: training RSS peak {rss:.3f}x ({verdict} the {BAR}x bar),"
            f" step live peak {live:.3f}x"
        )
    same = all(results[kind]["batches"] == results[kinds[0]]["batches"] for kind in kinds)
    lines.append(f"the same batches in all {len(kinds)}: {'yes' if same else 'NO'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- workers (children)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: ``args.worker``'s module fitted on the folder's first batches."""
    from plugintrain.callbacks import LoRA
    from plugintrain.core.preference_batch import unpack_reference
    from plugintrain.data import PreferenceDataModule
    from plugintrain.model_zoo import CausalLM, PreferenceLM

    lora, objective, *first_pass = args.worker.split("_")
    steps = args.warmup + 1 + args.steps
    data = PreferenceDataModule(
        str(args.data),
        batch_size=PAIRS,
        pad_multiple=args.pad_multiple,
        shuffle=False,
        reference_cache=str(args.work / f"cache_{time.time_ns()}"),
    )
    schedule = {"weight_decay": 0.0, "warmup_steps": 0, "lr_decay_steps": steps}
    schedule |= {"min_lr_ratio": 1.0, "optimizer": adamw(), "weights": str(args.weights)}
    recorder, fingerprint = _PluginTrainSteps(args), _Fingerprint()
    callbacks: list[L.Callback] = [recorder, fingerprint]
    if lora == "lora":
        callbacks.insert(0, LoRA(r=R, alpha=ALPHA, dropout=0.0, target_modules=list(TARGETS)))
    if objective == "dpo":
        reference = "adapters_off" if lora == "lora" else "data"
        reference = "first_pass" if first_pass else reference
        module = PreferenceLM(objective="sigmoid", beta=BETA, reference=reference, **schedule)
        cpu_trainer(steps, callbacks).fit(module, datamodule=data)
    else:
        data.setup("fit")
        pairs = data.train_set
        batches = []
        for step in range(steps):  # the data module's batches in file order (no shuffle)
            x, y = data.collate_fn([pairs[i] for i in range(step * PAIRS, (step + 1) * PAIRS)])
            batches.append((x, unpack_reference(y)[0]))  # the answer tokens the targets
        module = CausalLM(**schedule)
        fit_batches(module, callbacks, batches)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {**recorder.recorder.result(trainable), "batches": fingerprint.batches}


class _Fingerprint(L.Callback):
    """Each training batch's input shape and summed ids."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[int], int]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batches.append((list(batch[0].shape), int(batch[0].sum())))


# ---------------------------------------------------------------- entry point


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each kind")
    parser.add_argument("--steps", type=int, default=1, help="steps after the memory step")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the memory step")
    parser.add_argument(
        "--pad-multiple", type=int, default=64, help="rows padded to a multiple of this"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="measure these"
    )
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = _parse()
    if args.worker is not None:
        torch.manual_seed(SEED)
        print(RESULT + json.dumps(_worker(args)), flush=True)
        return
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    assets = ensure_assets(cache_dir(), reference=True)
    with tempfile.TemporaryDirectory() as work:
        # The LoRA runs start from the same adapters (B = 0), as in dpo_vs_trl.py.
        adapters = _initial_adapters(torch.Generator().manual_seed(SEED))
        torch.save(adapters, Path(work) / "adapters.pt")
        commands = {kind: _worker_command(kind, Path(work), assets, args) for kind in args.kinds}
        runs = alternate(commands, args.rounds, _peak)
    results = {kind: _summary(runs[kind]) for kind in args.kinds}
    print()
    print(_report(results, args))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args), "results": results}, default=str, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
