"""``plugintrain compare RUN_A RUN_B``: end-to-end loss diff and first diverging module.

A run is a TensorBoard log directory (event files are found recursively) and/or a
:class:`~plugintrain.callbacks.precision_check.PrecisionCheck` output directory. Losses
come from the event files (or, without them, from the checker's files); when both runs
have checker files, their per-module statistics are compared too, and the first module
that diverges is printed with its statistics side by side.

Exit status: 0 within tolerance, 1 beyond it or when one run lacks steps the other has
(they are listed), 2 on bad input (one line on stderr). The default tolerances
are relative, per compute dtype: 1e-5 for fp32 and 1e-2 for bf16, as in the reference
project; 1e-3 for fp16, whose 10-bit mantissa sits between the two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plugintrain.cli_messages import ConfigError

DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}
ComputeDtype = Literal[tuple(sorted(DEFAULT_RTOL))]  # type: ignore[valid-type]
_STATS = ("mean", "std", "absmax")


class CompareError(Exception):
    """Bad input: a missing directory, no losses, no common steps."""


@dataclass
class Run:
    """What one run recorded.

    Attributes:
        path: The run directory.
        losses: Loss by step (empty when the run has none).
        checks: PrecisionCheck records by step, for one rank (empty without checker files).
    """

    path: Path
    losses: dict[int, float]
    checks: dict[int, list[dict[str, Any]]]


def relative_diff(a: float, b: float) -> float:
    """``|a - b|`` relative to the larger magnitude (0 when both are 0, inf on NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def _event_scalars(path: Path, tag: str) -> dict[int, float] | None:
    """Scalars ``tag`` from every event file under ``path``; None if there are no files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = sorted(path.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not event_files:
        return None
    values: dict[int, float] = {}
    tags: set[str] = set()
    for event_file in event_files:  # oldest first: a resumed run overrides repeated steps
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0}).Reload()
        tags.update(accumulator.Tags()["scalars"])
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    if not values:
        raise CompareError(f"{path}: no scalar {tag!r} in the event files; found {sorted(tags)}.")
    return values


def _check_files(path: Path, rank: int) -> dict[int, dict[str, Any]]:
    payloads = (json.loads(f.read_text()) for f in path.rglob(f"step_*/rank_{rank:05d}.json"))
    return {payload["step"]: payload for payload in payloads}


def load_run(path: str | Path, tag: str = "train_loss", rank: int = 0) -> Run:
    """Read a run's losses (event files first, then checker files) and checker records.

    Raises:
        CompareError: If the directory is missing or holds no losses.
    """
    path = Path(path)
    if not path.is_dir():
        raise CompareError(f"{path}: no such directory.")
    checks = _check_files(path, rank)
    losses = _event_scalars(path, tag)
    if losses is None:
        losses = {step: p["loss"] for step, p in checks.items() if p.get("loss") is not None}
    if not losses and not checks:
        raise CompareError(f"{path}: no TensorBoard event files and no PrecisionCheck files.")
    return Run(path, losses, {step: p["records"] for step, p in checks.items()})


def compare_losses(a: Run, b: Run, rtol: float) -> tuple[list[tuple], int | None]:
    """Rows ``(step, loss_a, loss_b, rel_diff, ok)`` over common steps; first failing step."""
    steps = sorted(a.losses.keys() & b.losses.keys())
    rows = []
    for step in steps:
        diff = relative_diff(a.losses[step], b.losses[step])
        rows.append((step, a.losses[step], b.losses[step], diff, diff <= rtol))
    first_bad = next((row[0] for row in rows if not row[4]), None)
    return rows, first_bad


def record_diverges(rec_a: dict[str, Any], rec_b: dict[str, Any], rtol: float) -> bool:
    """Whether two records of the same tensor differ beyond ``rtol``.

    Shapes and NaN/Inf counts must match exactly; mean, std and abs-max may differ by
    ``rtol`` times the larger abs-max (a mean near zero has no useful relative error).
    Dtypes may differ: comparing a bf16 run with an fp32 one is the point.
    """
    if rec_a["shape"] != rec_b["shape"] or (rec_a["nan"], rec_a["inf"]) != (
        rec_b["nan"],
        rec_b["inf"],
    ):
        return True
    scale = max(abs(rec_a["absmax"]), abs(rec_b["absmax"]), 1e-30)
    return any(abs(rec_a[key] - rec_b[key]) > rtol * scale for key in _STATS)


def first_diverging_record(a: Run, b: Run, rtol: float) -> tuple[int, dict, dict] | None:
    """The first (step, record_a, record_b) that diverges, in recording order."""
    for step in sorted(a.checks.keys() & b.checks.keys()):
        by_name_b = {(r["name"], r["kind"]): r for r in b.checks[step]}
        for rec_a in a.checks[step]:
            rec_b = by_name_b.get((rec_a["name"], rec_a["kind"]))
            if rec_b is not None and record_diverges(rec_a, rec_b, rtol):
                return step, rec_a, rec_b
    return None


def _print_loss_table(rows: list[tuple], rtol: float) -> None:
    print(f"{'step':>6}  {'run A':>14}  {'run B':>14}  {'rel diff':>10}")
    for step, loss_a, loss_b, diff, ok in rows:
        flag = "" if ok else f"  > rtol {rtol:g}"
        print(f"{step:>6}  {loss_a:>14.7g}  {loss_b:>14.7g}  {diff:>10.3e}{flag}")


def _print_record_pair(step: int, rec_a: dict, rec_b: dict) -> None:
    print(f"first diverging module at step {step}: {rec_a['name']} ({rec_a['kind']})")
    for key in ("dtype", "shape", *_STATS, "nan", "inf", "hash"):
        print(f"  {key:>7}  A={rec_a[key]!s:<24} B={rec_b[key]!s}")


def step_ranges(steps: Sequence[int]) -> str:
    """Sorted steps as ranges: ``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def missing_steps(a: Run, b: Run) -> list[str]:
    """One line per run that lacks recorded steps the other run has (none: the same steps).

    A run that stopped early, or lost a log on resume, agrees with the other only over
    the steps it kept; comparing those alone would pass without saying so.
    """
    recorded = [("losses", a.losses.keys(), b.losses.keys())]
    if a.checks and b.checks:
        recorded.append(("module statistics", a.checks.keys(), b.checks.keys()))
    lines = []
    for what, steps_a, steps_b in recorded:
        for run, other, lacking in ((b, a, steps_a - steps_b), (a, b, steps_b - steps_a)):
            if lacking:
                steps = f"step{'s' if len(lacking) > 1 else ''} {step_ranges(sorted(lacking))}"
                lines.append(f"{run.path} lacks the {what} of {steps} that {other.path} has")
    return lines


def compare_runs(a: Run, b: Run, rtol: float) -> int:
    """Print the comparison of two loaded runs; return the exit status (0 or 1)."""
    rows, first_bad = compare_losses(a, b, rtol)
    if not rows and not (a.checks.keys() & b.checks.keys()):
        raise CompareError(f"{a.path} and {b.path} have no common steps.")
    if rows:
        _print_loss_table(rows, rtol)
        where = f"first at step {first_bad}" if first_bad is not None else "all within"
        print(f"losses over {len(rows)} common steps: {where} (rtol {rtol:g})")
    divergence = first_diverging_record(a, b, rtol)
    if divergence is not None:
        _print_record_pair(*divergence)
    elif a.checks and b.checks:
        print("module statistics: all within tolerance")
    missing = missing_steps(a, b)
    for line in missing:
        print(line)
    return 0 if first_bad is None and divergence is None and not missing else 1


def compare(
    run_a: str,
    run_b: str,
    *,
    tag: str = "train_loss",
    dtype: ComputeDtype = "fp32",
    rtol: float | None = None,
    rank: int = 0,
) -> int:
    """Diff two runs' losses and module statistics within a tolerance.

    Compares two runs' losses (and PrecisionCheck statistics) and prints the first module
    that diverges. Exit status 0 within tolerance, 1 beyond it or when a run lacks steps
    the other has, 2 on bad input.

    Args:
        run_a: reference run: TensorBoard log dir or PrecisionCheck dir
        run_b: run to check against it
        tag: scalar tag of the loss
        dtype: compute dtype whose default tolerance applies (fp32 1e-5, bf16 1e-2,
            fp16 1e-3)
        rtol: relative tolerance override
        rank: rank whose checker files to read
    """
    rtol = DEFAULT_RTOL[dtype] if rtol is None else rtol
    if not math.isfinite(rtol) or rtol < 0:
        raise ConfigError(f"--rtol must be a finite number >= 0, got {rtol}")
    try:
        return compare_runs(load_run(run_a, tag, rank), load_run(run_b, tag, rank), rtol)
    except CompareError as error:
        raise ConfigError(str(error)) from None
