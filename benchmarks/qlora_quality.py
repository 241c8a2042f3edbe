"""QLoRA's quality against LoRA on the full-precision base (the baseline), in one command::

    .venv/bin/python benchmarks/qlora_quality.py [--out runs/qlora_quality] [--json PATH]

Two recipes, each trained twice through ``plugintrain fit`` with the same seed and steps:
as shipped (LoRA, the fp32 base: the baseline) and with the LoRA callback's
``quantize: nf4`` (QLoRA; ``--int8`` adds ``quantize: int8``). Then ``plugintrain
evaluate`` of each run's last adapter checkpoint on held-out data:

* **Shakespeare**: ``recipes/smollm2_lora_shakespeare_cpu.yaml`` against
  ``recipes/smollm2_qlora_shakespeare_cpu.yaml`` (the same recipe with ``quantize: nf4``),
  bits per byte of the validation split's first 48 windows of 512 tokens (24,576 tokens of
  three plays no run trains on: ``evaluate --data data/shakespeare_smollm2-135m --seq_len
  512 --limit 48``). The issue's bar: QLoRA within 2% of LoRA.
* **Dates** (the chat demo of ``docs/guides/chat.md``): ``recipes/smollm2_lora_chat_cpu.yaml``
  and the same with ``quantize: nf4``, exact match of the generated answers on the 100
  held-out conversations (``evaluate --data data/dates_chat --max_new_tokens 16``). The
  bar: within 5 points of LoRA's.

``evaluate`` reads a QLoRA checkpoint as the model the run trained: the base quantized and
dequantized, the adapters merged. Data are prepared first if missing (``prepare
shakespeare``, ``prepare dates``, ``prepare chat``). Runs go under ``--out``; a run whose
``last.ckpt`` is there already is evaluated, not trained again. Nothing is timed (the
fits take about 4 + 4 + 2 + 2 minutes on two idle cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "plugintrain"]
SHAKESPEARE = "data/shakespeare_smollm2-135m"
DATES_CHAT = "data/dates_chat"


def _run(args: list[str]) -> str:
    print("$ plugintrain", " ".join(args), flush=True)
    out = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"plugintrain {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def _prepare() -> None:
    if not (ROOT / SHAKESPEARE).exists():
        _run(["prepare", "shakespeare", "--tokenizer", "smollm2-135m"])
    if not (ROOT / DATES_CHAT).exists():
        _run(["prepare", "dates", "--out", "data/dates.jsonl"])
        _run(["prepare", "chat", "data/dates.jsonl", "--tokenizer", "smollm2-135m",
              "--out", DATES_CHAT, "--seq_len", "256", "--val_examples", "100"])  # fmt: skip


def _variant(recipe: Path, quantize: str | None, out: Path, name: str) -> Path:
    """``recipe`` with the LoRA callback's ``quantize`` set, logging and checkpointing
    under ``out/name``; the path of the config written."""
    config = yaml.safe_load(recipe.read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("LoRA"):
            callback["init_args"]["quantize"] = quantize
    config["trainer"]["logger"]["init_args"].update(save_dir=str(out), name=name)
    config["checkpoint"] = {**config.get("checkpoint", {}), "dirpath": str(out / name / "ckpt")}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _evaluate(checkpoints: Path, data: str, extra: list[str]) -> dict[str, Any]:
    text = _run(["evaluate", "--adapter", str(checkpoints / "last.ckpt"), "--data", data,
                 "--json", "-", *extra])  # fmt: skip
    return json.loads(text[text.index("{") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "qlora_quality")
    parser.add_argument("--int8", action="store_true", help="also train with quantize: int8")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    _prepare()
    kinds = [None, "nf4"] + (["int8"] if args.int8 else [])
    tasks = {
        "shakespeare": (
            ROOT / "recipes/smollm2_lora_shakespeare_cpu.yaml",
            SHAKESPEARE,
            ["--seq_len", "512", "--limit", "48"],
        ),
        "dates": (
            ROOT / "recipes/smollm2_lora_chat_cpu.yaml",
            DATES_CHAT,
            ["--max_new_tokens", "16"],
        ),
    }
    results: dict[str, dict[str, Any]] = {}
    for task, (recipe, data, extra) in tasks.items():
        for kind in kinds:
            name = f"{task}_{kind or 'lora'}"
            config = _variant(recipe, kind, args.out, name)
            if not (args.out / name / "ckpt" / "last.ckpt").exists():
                _run(["fit", "--config", str(config)])
            results.setdefault(task, {})[kind or "lora"] = _evaluate(
                args.out / name / "ckpt", data, extra
            )
    print()
    print("| task | metric | lora (baseline) | " + " | ".join(k for k in kinds if k) + " |")
    print("|---|---|---:|" + "---:|" * (len(kinds) - 1))
    for task, metric in (("shakespeare", "bits_per_byte"), ("dates", "exact_match")):
        row = results[task]
        base = _metric(row["lora"], metric)
        cells = []
        for kind in kinds[1:]:
            value = _metric(row[kind], metric)
            diff = (
                f"{100 * (value / base - 1):+.2f}%"
                if metric == "bits_per_byte"
                else f"{100 * (value - base):+.0f} points"
            )
            cells.append(f"{value:.4f} ({diff})")
        print(f"| {task} | {metric} | {base:.4f} | " + " | ".join(cells) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _metric(result: dict[str, Any], metric: str) -> float:
    """``metric`` from ``evaluate --json``'s output (searched one level down as well)."""
    if metric in result:
        return float(result[metric])
    for value in result.values():
        if isinstance(value, dict) and metric in value:
            return float(value[metric])
    raise KeyError(f"{metric} not in evaluate's output: {sorted(result)}")


if __name__ == "__main__":
    main()
