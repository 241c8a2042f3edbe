"""Turn the ranks' measurements into one record per configuration, a table, and plots.

A record (one JSON object per configuration, ``results.json`` holds the list) has:

- ``name``, ``status`` (``ok`` or ``failed``), ``error`` (the last line the run printed
  on failure), ``command`` (the exact command line), ``seconds`` (its wall time);
- ``tokens_per_s`` (global: one count per data-parallel replica, not per tp x pp rank)
  and ``tokens_per_s_per_device``; ``step_s_median``, ``step_s_min``, ``step_s_max`` and
  ``step_spread`` ((max - min) / median) of the slowest rank's step times;
- ``peak_bytes`` (per rank, and ``peak_source``), ``param_bytes``, ``grad_bytes``,
  ``optimizer_bytes`` (per rank);
- ``mfu`` (None where the device's dense peak is unknown, e.g. CPUs), ``loss`` (the
  mean over ranks that hold one, of the last timed step), and ``vs_baseline``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def merge_ranks(out_dir: Path) -> dict[str, Any]:
    """One configuration's record from the ``rank<N>.json`` files its ranks wrote."""
    files = sorted(out_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"no rank*.json in {out_dir}: the run wrote no measurements")
    ranks = [json.loads(p.read_text()) for p in files]
    world = ranks[0]["world_size"]
    if len(ranks) != world:
        raise FileNotFoundError(f"{len(ranks)} of {world} ranks wrote measurements")
    counts = {len(r["step_seconds"]) for r in ranks}
    if len(counts) != 1 or 0 in counts:
        timed = sorted(counts)
        raise ValueError(f"ranks timed {timed} steps: the run ended early or a rank failed")
    # Ranks run the same steps; a step lasts as long as its slowest rank.
    steps = [max(times) for times in zip(*(r["step_seconds"] for r in ranks), strict=True)]
    median = statistics.median(steps)
    tokens = ranks[0]["tokens_per_step"] * ranks[0]["replicas"]
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    flops, peak = ranks[0]["flops_per_token"], ranks[0]["peak_flops"]
    return {
        "world_size": world,
        "replicas": ranks[0]["replicas"],
        "device": ranks[0]["device"],
        "timed_steps": len(steps),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median,
        "tokens_per_s_per_device": tokens / median / world,
        "step_s_median": median,
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "step_spread": (max(steps) - min(steps)) / median,
        "peak_bytes": [r["peak_bytes"] for r in ranks],
        "peak_source": ranks[0]["peak_source"],
        "param_bytes": [r["param_bytes"] for r in ranks],
        "grad_bytes": [r["grad_bytes"] for r in ranks],
        "optimizer_bytes": [r["optimizer_bytes"] for r in ranks],
        "flops_per_token": flops,
        "mfu": None if not (flops and peak) else flops * tokens / median / (peak * world),
        "loss": statistics.fmean(losses) if losses else None,
    }


def add_ratios(records: list[dict[str, Any]]) -> str | None:
    """Set each record's ``vs_baseline`` (tokens/s over the baseline's); the baseline's
    name, or None when the baseline failed."""
    marked = [r for r in records if r.get("baseline")] or records[:1]
    base = marked[0] if marked else None
    ok = base is not None and base["status"] == "ok"
    for record in records:
        fine = ok and record["status"] == "ok"
        record["vs_baseline"] = record["tokens_per_s"] / base["tokens_per_s"] if fine else None
    return base["name"] if ok else None


def _mib(values: list[int | None]) -> str:
    """Per-rank bytes as MiB: one figure when all ranks agree, else their range."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known) / 2**20, max(known) / 2**20
    return f"{low:.1f}" if high - low < 0.05 else f"{low:.1f}-{high:.1f}"


def markdown(records: list[dict[str, Any]], baseline: str | None, machine: str) -> str:
    """The summary table (one row per configuration, failed ones with their error)."""
    lines = [
        f"Measured on {machine}. Ratios are tokens/s over `{baseline or 'no baseline'}`.",
        "",
        "| configuration | ranks | tokens/s | per device | vs baseline | step ms (spread) "
        "| peak MiB/rank | params / grads / optim MiB/rank | MFU | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | failed: {_cell(r['error'])} |||||||||")
            continue
        state = " / ".join(_mib(r[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        loss = "-" if r["loss"] is None else f"{r['loss']:.3f}"
        ratio = "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x"
        lines.append(
            f"| {r['name']} | {r['world_size']} | {r['tokens_per_s']:,.0f} |"
            f" {r['tokens_per_s_per_device']:,.0f} | {ratio} |"
            f" {1000 * r['step_s_median']:.0f} (±{50 * r['step_spread']:.0f}%) |"
            f" {_mib(r['peak_bytes'])} | {state} | {mfu} | {loss} |"
        )
    return "\n".join(lines) + "\n"


def _most(values: list[int | None]) -> int:
    return max((v for v in values if v is not None), default=0)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def plots(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Bar charts of throughput, peak memory per rank and (where known) MFU, as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["status"] == "ok"]
    charts = {
        "throughput.png": ("tokens/s (global)", [r["tokens_per_s"] for r in ok]),
        "memory.png": ("peak MiB per rank (max)", [_most(r["peak_bytes"]) / 2**20 for r in ok]),
    }
    if any(r["mfu"] is not None for r in ok):
        charts["mfu.png"] = ("MFU %", [100 * (r["mfu"] or 0.0) for r in ok])
    written = []
    for file, (label, values) in charts.items():
        figure, axes = plt.subplots(figsize=(8, 0.4 * len(ok) + 1.2))
        axes.barh([r["name"] for r in ok], values)
        axes.invert_yaxis()  # matrix order, top to bottom
        axes.set_xlabel(label)
        figure.tight_layout()
        figure.savefig(out_dir / file, dpi=100)
        plt.close(figure)
        written.append(out_dir / file)
    return written
