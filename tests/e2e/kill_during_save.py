"""Kill a training job at random points inside a checkpoint save, then resume it.

For each strategy: one uninterrupted run (8 steps, a checkpoint every 2) counts how many
file-system steps each save takes on each rank; then each attempt SIGKILLs the whole job
just before a random one of those steps of step 4's first or second save (its new
checkpoint, or the one replacing ``last.ckpt``), resumes
with ``--ckpt_path last`` and checks that the resumed run logs the losses of the
uninterrupted run. A failed resume, a wrong loss
or a leftover ``.partial`` / ``.retired`` entry is a failure.

    python tests/e2e/kill_during_save.py --attempts 20 [--strategies single zero2 ...]

prints one line per attempt and a table of counts. ``tests/e2e/test_kill_during_save.py``
kills each of two strategies at its most delicate point in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "llama3_debug_hybrid_cpu.yaml"
NAME = "llama3_debug_hybrid_cpu"
STEPS = 8
_DEVICES, _STRATEGY, _BATCH = (
    "--trainer.devices",
    "--trainer.strategy",
    "--data.init_args.batch_size",
)
STRATEGIES = {
    "single": [_DEVICES, "1", _STRATEGY, "auto", _BATCH, "4"],
    "zero2x2": [_DEVICES, "2", _STRATEGY, "zero2", _BATCH, "2"],
    "hybrid_dp2_tp2": [_DEVICES, "4", _BATCH, "2"],
    "pipeline_pp2": [_DEVICES, "2", _STRATEGY, "pipeline", _BATCH, "4"],
}


@dataclass
class Outcome:
    """Counts of one strategy's attempts."""

    killed_in_save: int = 0
    save_finished_first: int = 0
    resumed_exactly: int = 0
    failures: list[str] = field(default_factory=list)


def fit_args(data: Path, out: Path, strategy: str, *extra: str) -> list[str]:
    """``plugintrain`` arguments of ``strategy``'s run, logging (and checkpointing) under
    ``out``."""
    return [
        "fit", "--config", str(RECIPE), "--data.init_args.data_dir", str(data),
        "--data.init_args.seq_len", "32", "--trainer.limit_val_batches", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--model.init_args.lr_decay_steps", str(STEPS),
        "--model.init_args.warmup_steps", "2", "--checkpoint.every_n_train_steps", "2",
        "--trainer.max_steps", str(STEPS), "--trainer.logger.init_args.save_dir", str(out),
        *STRATEGIES[strategy], *extra,
    ]  # fmt: skip


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    # A session of its own: the injected kill takes out its whole process group.
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        start_new_session=True,
    )


def _losses(out: Path) -> dict[int, float]:
    """The losses the newest run logged under ``out`` (a killed run may have logged none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    versions = sorted((out / NAME).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    events = EventAccumulator(str(versions[-1]))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train_loss")}


def save_events(
    data: Path, work: Path, strategy: str, *extra: str
) -> tuple[dict[int, float], dict[tuple[int, int], int]]:
    """An uninterrupted run (``extra``: more CLI options): its losses, and the steps of
    each (save, rank). It logs under ``work / f"{strategy}_reference"``."""
    out = work / f"{strategy}_reference"
    proc = _run([*_killer(0, "0", -1), *fit_args(data, out, strategy, *extra)], work)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} reference run failed:\n{proc.stderr[-6000:]}")
    counts = re.findall(r"SAVE (\d+) EVENTS rank (\d+): (\d+)", proc.stdout)
    return _losses(out), {(int(save), int(rank)): int(n) for save, rank, n in counts}


def _killer(save: int, event: str, rank: int) -> list[str]:
    script = str(Path(__file__).with_name("_kill_in_save.py"))
    return [sys.executable, script, str(save), event, str(rank)]


def attempt(
    data: Path,
    work: Path,
    strategy: str,
    expected: dict[int, float],
    where: tuple[int, str, int],
    resume_as: str | None = None,
    resume: Callable[[list[str], Path], subprocess.CompletedProcess] | None = None,
) -> tuple[bool, str | None]:
    """Kill ``strategy``'s job at ``where`` = (save, event, rank) and resume it (under
    ``resume_as``, default the same strategy); returns (the kill landed inside the save,
    what went wrong or None). ``expected`` are the resuming layout's uninterrupted losses
    (a data-parallel run logs rank 0's share of the batch). ``resume(args, cwd)`` runs
    ``plugintrain args`` for the resume (default: ``python -m plugintrain`` in a fresh
    interpreter)."""
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{strategy}_"))
    killed = _run([*_killer(*where), *fit_args(data, out, strategy)], work)
    landed = "KILLED at save event" in killed.stdout
    resume = resume or (lambda args, cwd: _run([sys.executable, "-m", "plugintrain", *args], cwd))
    resumed = resume(fit_args(data, out, resume_as or strategy, "--ckpt_path", "last"), work)
    where = f"{strategy} killed in save {where[0]} at event {where[1]} of rank {where[2]}"
    if resumed.returncode != 0:
        return landed, f"{where}: resume exited {resumed.returncode}: {resumed.stderr[-2000:]}"
    leftovers = sorted(
        p.name
        for p in (out / NAME / "checkpoints").iterdir()
        if "." in p.suffix and p.suffix not in (".ckpt",)
    )
    losses = _losses(out)  # the resumed run's: from its checkpoint's step to the end
    wrong = [
        step
        for step, loss in losses.items()
        if abs(loss - expected[step]) > 1e-4 * abs(expected[step])
    ]
    resumed_at = min(losses)
    if (
        leftovers
        or wrong
        or resumed_at not in (2, 4)
        or sorted(losses) != list(range(resumed_at, STEPS))
    ):
        return (
            landed,
            f"{where}: leftovers {leftovers}, wrong steps {wrong}, steps {sorted(losses)}",
        )
    return landed, None


def run(
    data: Path, work: Path, strategies: list[str], attempts: int, seed: int
) -> dict[str, Outcome]:
    """Every strategy's attempts at random points; prints a line per attempt."""
    rng = random.Random(seed)
    outcomes = {}
    for strategy in strategies:
        expected, events = save_events(data, work, strategy)  # its uninterrupted run
        outcome = outcomes[strategy] = Outcome()
        for i in range(attempts):
            save, rank = rng.choice([k for k, n in events.items() if k[0] in (3, 4) and n > 0])
            event = str(rng.randint(1, events[save, rank]))
            landed, failure = attempt(data, work, strategy, expected, (save, event, rank))
            outcome.killed_in_save += landed
            outcome.save_finished_first += not landed
            if failure is None:
                outcome.resumed_exactly += 1
            else:
                outcome.failures.append(failure)
            print(
                f"{strategy} attempt {i + 1} (save {save}, rank {rank}, event"
                f" {event}/{events[save, rank]}):"
                f" killed in save={landed} ok={failure is None}",
                flush=True,
            )
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=20)
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES)
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from plugintrain.data import prepare_shakespeare

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_shakespeare(work / "data", tokenizer="llama3")
        outcomes = run(work / "data", work, args.strategies, args.attempts, args.seed)
    print("| strategy | attempts | killed inside save | save finished first | resumed exactly |")
    print("|---|---|---|---|---|")
    for strategy, o in outcomes.items():
        total = o.killed_in_save + o.save_finished_first
        counts = (total, o.killed_in_save, o.save_finished_first, o.resumed_exactly)
        print(f"| {strategy} | " + " | ".join(map(str, counts)) + " |")
    for o in outcomes.values():
        for failure in o.failures:
            print("FAILED:", failure)
    return 1 if any(o.failures for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
