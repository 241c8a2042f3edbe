"""Start-up: how long a ``plugintrain`` command takes before it can answer.

Each command runs in a fresh interpreter ``--repeats`` times (median reported), beside
the named baseline ``python -c "import torch"`` run the same way in the same command, so
the ratios hold on a busy machine too. The commands that train nothing (``--help`` of the
tools) should not import Lightning, or even torch; ``fit`` with a mistyped option should
report it before building the whole Trainer parser.

    python benchmarks/startup.py                 # the table, as in the README
    python benchmarks/startup.py --json out.json

Run it from the repository root (the fit row reads ``recipes/``) with the project's
virtualenv on PATH or as ``.venv/bin/python benchmarks/startup.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASELINE = ("import torch", [sys.executable, "-c", "import torch"])
RECIPE = "recipes/gpt2_debug_shakespeare_cpu.yaml"
COMMANDS = {
    "prepare --help": ["prepare", "--help"],
    "prepare text --help": ["prepare", "text", "--help"],
    "--help (the command list)": ["--help"],
    "convert --help": ["convert", "--help"],
    "estimate --help": ["estimate", "--help"],
    "generate --help": ["generate", "--help"],
    "recipes": ["recipes"],
    "generate --max_new 5 (a typo)": ["generate", "--max_new", "5"],
    "estimate --microbatchs 4 (a typo)": ["estimate", "llama3.1-8b", "--microbatchs", "4"],
    "fit --trainer.max_step 5 (a typo)": ["fit", "--config", RECIPE, "--trainer.max_step", "5"],
    "fit --help": ["fit", "--help"],
    "fit --trainer.strategy nonsense (parsed, then refused)": [
        "fit",
        "--config",
        RECIPE,
        "--trainer.strategy",
        "nonsense",
    ],
}
"""Row name -> ``plugintrain`` arguments."""


def seconds(argv: list[str], repeats: int) -> tuple[float, int]:
    """Median wall time of ``argv`` over ``repeats`` runs, and its exit status."""
    times, status = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
        status = proc.returncode
    return statistics.median(times), status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    plugintrain = [sys.executable, "-m", "plugintrain"]
    base, _ = seconds(BASELINE[1], args.repeats)
    rows = [{"command": BASELINE[0], "seconds": base, "ratio": 1.0, "exit": 0}]
    for name, argv in COMMANDS.items():
        took, status = seconds([*plugintrain, *argv], args.repeats)
        rows.append({"command": f"plugintrain {name}", "seconds": took,
                     "ratio": took / base, "exit": status})  # fmt: skip
    print(f"median of {args.repeats} fresh processes; ratio: x `python -c 'import torch'`")
    print("| command | seconds | ratio | exit |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| `{row['command']}` | {row['seconds']:.2f} | {row['ratio']:.2f} | {row['exit']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
