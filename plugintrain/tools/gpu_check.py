"""``plugintrain gpu-check`` (``make gpu-check``, ``python -m plugintrain.tools.gpu_check``):
one prepared check of the CUDA path on a machine with one GPU, in a few minutes.

It runs :mod:`plugintrain.bench.gpu_checks` (logits against the CPU for every model family,
training steps in each reduced precision, each strategy that fits one process against
the CPU's losses, GPT-2 124M / Llama 3.2 1B throughput with MFU and peak memory, QLoRA's
quantization against the CPU and a Llama 3.2 1B QLoRA row with tokens/s and peak memory),
prints one table and writes it as JSON. Exit status 0 when every check passed, 1 when one
failed. Without a CUDA device it is a dry run: it says so, checks nothing and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Literal, get_args

NCCL_NOTE = (
    "Not checked here: NCCL between GPUs. On one GPU every strategy runs at world size 1"
    " (a one-rank process group), so no collective crosses devices. The guards for"
    " multi-rank runs are the schedule simulator's rendezvous proof"
    " (tests/unit/test_pipeline_schedules.py) and the gloo runs of tests/distributed."
)
Section = Literal["logits", "precision", "strategy", "throughput", "qlora", "qlora_throughput"]
SECTIONS: tuple[Section, ...] = get_args(Section)


def _machine() -> dict[str, str]:
    import torch

    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def gpu_check(
    *, out: str = "runs/gpu_check/gpu_check.json", sections: list[Section] | None = None
) -> int:
    """Check the CUDA path against the CPU on one GPU (a dry run without one).

    Exit status 0 when every check passed, 1 when one failed; without a CUDA device it
    checks nothing and exits 0.

    Args:
        out: where the table is written as JSON
        sections: which checks to run (default: all)
    """
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
    from plugintrain.bench import gpu_checks

    rows = gpu_checks.run_checks(torch.device("cuda", 0), sections or SECTIONS)
    total = time.perf_counter() - start
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed} of {len(rows)} checks passed in {total:.0f} s.")
    print(NCCL_NOTE)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {**machine, "seconds": total, "checks": rows, "not_checked": NCCL_NOTE}
    path.write_text(json.dumps(report, indent=1))
    print(f"written: {path}")
    return 1 if failed else 0


if __name__ == "__main__":  # `make gpu-check`: python -m plugintrain.tools.gpu_check
    from plugintrain.tools import run_command

    sys.exit(run_command("gpu-check", sys.argv[1:]))
