"""``plugintrain gpu-check`` (``make gpu-check``, ``python -m plugintrain.tools.gpu_check``):
one prepared check of the CUDA path on a machine with one GPU, in a few minutes.

It runs :mod:`plugintrain.bench.gpu_checks` (logits against the CPU for every model family,
training steps in each reduced precision, each strategy that fits one process against
the CPU's losses, and GPT-2 124M / Llama 3.2 1B throughput with MFU and peak memory),
prints one table and writes it as JSON. Exit status 0 when every check passed, 1 when one
failed. Without a CUDA device it is a dry run: it says so, checks nothing and exits 0.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from plugintrain.tools._args import ToolParser

if TYPE_CHECKING:
    import torch

NCCL_NOTE = (
    "Not checked here: NCCL between GPUs. On one GPU every strategy runs at world size 1"
    " (a one-rank process group), so no collective crosses devices. The guards for"
    " multi-rank runs are the schedule simulator's rendezvous proof"
    " (tests/unit/test_pipeline_schedules.py) and the gloo runs of tests/distributed."
)
SECTIONS = ("logits", "precision", "strategy", "throughput")


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="plugintrain gpu-check",
        description="Check the CUDA path against the CPU on one GPU (a dry run without one).",
    )
    parser.add_argument(
        "--out",
        default="runs/gpu_check/gpu_check.json",
        help="where the table is written as JSON (default: %(default)s)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which checks to run (default: all)",
    )
    return parser


def planned_checks(
    device: torch.device, sections: Sequence[str]
) -> list[tuple[str, str, Callable]]:
    """(section, name, check) triples to run on ``device``, in report order."""
    from plugintrain.bench import gpu_checks as checks

    plan = {
        "logits": (checks.FAMILIES, checks.logits_parity),
        "precision": (checks.PRECISIONS, checks.precision_trains),
        "strategy": (checks.STRATEGIES, checks.strategy_parity),
        "throughput": (tuple(checks.THROUGHPUT_RUNS), checks.throughput),
    }
    return [
        (section, name, functools.partial(plan[section][1], name, device))
        for section in sections
        for name in plan[section][0]
    ]


def run_checks(device: torch.device, sections: Sequence[str]) -> list[dict]:
    """Run the planned checks; one that raises is a failed check naming its exception
    (the rest still run), with the traceback on stderr."""
    from plugintrain.bench.gpu_checks import Check, quiet

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


def _machine() -> dict[str, str]:
    import torch

    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; see the module docstring."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build:"
            f" {torch.version.cuda or 'none'}). Dry run: nothing was checked, no table"
            " was written."
        )
        print(NCCL_NOTE)
        return 0
    machine = _machine()
    print(f"gpu-check on {machine['device']} (torch {machine['torch']}, CUDA {machine['cuda']})")
    print(f"{'section':<11} {'check':<24} {'result':<5} {'time':>7}  detail")
    start = time.perf_counter()
    rows = run_checks(torch.device("cuda", 0), args.sections)
    total = time.perf_counter() - start
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed} of {len(rows)} checks passed in {total:.0f} s.")
    print(NCCL_NOTE)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**machine, "seconds": total, "checks": rows, "not_checked": NCCL_NOTE}
    out.write_text(json.dumps(report, indent=1))
    print(f"written: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
