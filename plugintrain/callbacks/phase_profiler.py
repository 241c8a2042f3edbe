"""PhaseProfiler: where each training step's time goes, per phase and rank.

It turns on :mod:`plugintrain.core.profiling`'s ranges for the training steps it profiles,
writes a Chrome trace per rank, and prints a per-phase table at the end of fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from plugintrain.core import profiling
from plugintrain.core.profiling import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    PHASES,
    TRAIN_STEP,
    PhaseTotal,
    Recorder,
    RecordsComputeRanges,
)

# Phase -> (min, max) total seconds over the ranks.
Spread = dict[str, tuple[float, float]]


class PhaseProfiler(Callback):
    """Record plugintrain's phase ranges during training; trace and summarize them.

    Every strategy records its communication (gradient reduce / reduce-scatter, parameter
    all-gather, pipeline transfers: :data:`plugintrain.core.profiling.PHASES`); this callback
    adds ``train_step``, ``optimizer`` and, where Lightning's loop runs the step,
    ``forward`` and ``backward`` (a pipeline records those per micro-batch itself). At
    the end of fit each rank writes ``phases_rank<r>.json`` (Chrome trace-event format;
    open it in https://ui.perfetto.dev) and rank 0 prints one row per phase: count, total
    seconds, mean milliseconds and share of the step on rank 0, and the smallest and
    largest total over the ranks (one small collective of per-phase totals).

    Ranges nest (``grad_reduce_scatter`` inside ``backward``, ``param_all_gather`` inside
    ``optimizer``), so shares add up to more than 100%. On CUDA every range synchronizes
    the current stream at both ends (see :mod:`plugintrain.core.profiling`), which costs
    throughput while profiling; profile a few steps, not a whole run.

    Args:
        skip_first: Training batches not profiled at the start (warm-up: allocator,
            autotuning, first-call compilation).
        max_steps: Profile at most this many batches after the skipped ones; None: all.
        dirpath: Where the traces go; None: the trainer's log directory.
    """

    def __init__(
        self, skip_first: int = 1, max_steps: int | None = 20, dirpath: str | None = None
    ) -> None:
        if skip_first < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(
                f"PhaseProfiler needs skip_first >= 0 and max_steps >= 1 (or None), got"
                f" skip_first={skip_first}, max_steps={max_steps}."
            )
        self.skip_first = skip_first
        self.max_steps = max_steps
        self.dirpath = dirpath
        self.recorder = Recorder()
        self.summary = ""
        """The table printed at the end of fit (rank 0; empty elsewhere)."""
        self.trace_path: Path | None = None
        """This rank's Chrome trace, once written."""
        self._batches = 0
        self._open: dict[str, Any] = {}
        self._hooks: list[RemovableHandle] = []
        self._compute_by_strategy = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.recorder = Recorder(trainer.strategy.root_device)
        strategy = trainer.strategy
        self._compute_by_strategy = (
            isinstance(strategy, RecordsComputeRanges) and strategy.records_compute_ranges
        )
        # Post-step hooks run in registration order: a gradient engine's parameter sync,
        # registered at setup, runs inside the optimizer range.
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in trainer.optimizers]

    def _after_step(self, optimizer: Optimizer, *_: Any) -> None:
        self._close(OPTIMIZER)

    def _open_range(self, name: str) -> None:
        context = self._open[name] = profiling.record(name)
        context.__enter__()

    def _close(self, name: str) -> None:
        if name in self._open:
            self._open.pop(name).__exit__(None, None, None)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        profiled = self._batches - self.skip_first
        if profiled < 1 or (self.max_steps is not None and profiled > self.max_steps):
            return
        profiling.start(self.recorder)
        self._open_range(TRAIN_STEP)
        if not self._compute_by_strategy:
            self._open_range(FORWARD)

    @override
    def on_before_zero_grad(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._close(FORWARD)  # Lightning zeroes gradients between training_step and backward

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        self._close(FORWARD)
        if not self._compute_by_strategy:
            self._open_range(BACKWARD)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(BACKWARD)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._open_range(OPTIMIZER)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # An FP16 step skipped on overflow never reaches the optimizer's post-step hook.
        for name in (OPTIMIZER, BACKWARD, FORWARD, TRAIN_STEP):
            self._close(name)
        if profiling.active() is self.recorder:
            profiling.stop()
            self.recorder.step += 1

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank gets here, so the collectives below (log_dir, totals) are safe.
        directory = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        self.trace_path = write_trace(self.recorder, directory, trainer.global_rank)
        totals = profiling.phase_totals(self.recorder.ranges)
        spread = _spread_over_ranks(totals)
        if trainer.global_rank == 0:
            self.summary = summary_table(totals, spread, self.recorder.step)
            print(self.summary, flush=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if profiling.active() is self.recorder:
            profiling.stop()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def write_trace(recorder: Recorder, directory: Path, rank: int) -> Path:
    """Write ``recorder``'s ranges as ``directory/phases_rank<rank>.json``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"phases_rank{rank}.json"
    path.write_text(json.dumps(profiling.chrome_trace(recorder.ranges, rank)))
    return path


def _spread_over_ranks(totals: dict[str, PhaseTotal]) -> Spread:
    """Per phase, the smallest and largest total seconds over the world's ranks."""
    mine = {name: total.seconds for name, total in totals.items()}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {name: (seconds, seconds) for name, seconds in mine.items()}
    everyone: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    spread: Spread = {}
    for rank_totals in everyone:
        for name, seconds in (rank_totals or {}).items():
            low, high = spread.get(name, (seconds, seconds))
            spread[name] = (min(low, seconds), max(high, seconds))
    return spread


def summary_table(totals: dict[str, PhaseTotal], spread: Spread, steps: int) -> str:
    """The per-phase table: rank 0's count, total, mean and share of ``train_step``, and
    the min/max total over ranks (a phase a rank never ran counts only where it ran)."""
    step_seconds = totals[TRAIN_STEP].seconds if TRAIN_STEP in totals else 0.0
    header = f"{'phase':<20} {'count':>6} {'total s':>9} {'mean ms':>9} {'% step':>7}"
    header += f" {'min s':>9} {'max s':>9}"
    lines = [f"Phase profile: {steps} training steps (rank 0; min/max over ranks)", header]
    lines.append("-" * len(header))
    seen = [*totals, *(name for name in spread if name not in totals)]
    for name in [*(n for n in PHASES if n in seen), *(n for n in seen if n not in PHASES)]:
        total = totals.get(name, PhaseTotal(0, 0.0))
        mean_ms = 1e3 * total.seconds / total.count if total.count else 0.0
        share = 100 * total.seconds / step_seconds if step_seconds else 0.0
        low, high = spread.get(name, (total.seconds, total.seconds))
        lines.append(
            f"{name:<20} {total.count:>6} {total.seconds:>9.3f} {mean_ms:>9.2f} {share:>6.1f}%"
            f" {low:>9.3f} {high:>9.3f}"
        )
    return "\n".join(lines)
