"""A dry run of chosen ranks set against the estimate: the ranks built, the estimate's figures
for the same positions, the problems found, as a table or as JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugintrain.estimate.dry_run.build import DryRank
from plugintrain.estimate.dry_run.checks import (
    balance_problems,
    estimate_problems,
    ownership_problems,
    p2p_problems,
    planned_total,
    trainable_stages,
)
from plugintrain.estimate.dry_run.pool import build_ranks
from plugintrain.estimate.dry_run.trace import untraced
from plugintrain.estimate.layout import Layout
from plugintrain.estimate.search import RankMemory, estimate
from plugintrain.model_zoo.config import TransformerConfig


@dataclass(frozen=True)
class DryRunReport:
    """A dry run's ranks, the estimate's figures for them, and the problems found."""

    ranks: list[DryRank]
    estimated: dict[int, RankMemory]
    """Rank -> the estimate's rank at the same (pp, dp, cp) position."""
    seconds: float
    peak_rss: int
    """The largest peak resident memory: this process's or a rank's process's, in bytes."""
    world_size: int
    problems: list[str]

    def totals(self, r: DryRank) -> int:
        """A rank's dry-run training state plus the estimate's activations and buffers."""
        return planned_total(r, self.estimated[r.rank])

    def table(self, size: Callable[[int], str]) -> str:
        """Ranks with the same figures on one row, with their count and stages."""
        rows: dict[tuple, list[DryRank]] = {}  # by the figures shown (padding bytes apart)
        for r in self.ranks:
            shown = tuple(size(n) for n in (*r.training_state, self.totals(r)))
            same = r.training_state == self.estimated[r.rank].training_state
            rows.setdefault((*shown, same), []).append(r)
        lines = [
            f"dry run of {len(self.ranks)} of {self.world_size} ranks (fake process group,"
            f" meta tensors): {self.seconds:.1f} s, peak RSS {size(self.peak_rss)}",
            "",
            f"{'ranks':>6}  {'stages':<14}{'parameters':>12}{'gradients':>12}{'optimizer':>12}"
            f"{'total':>12}  estimate",
        ]
        for (params, grads, opt, total, same), members in rows.items():
            stages = sorted({m.pp_rank for m in members})
            named = ",".join(map(str, stages)) if len(stages) <= 4 else f"{len(stages)} stages"
            lines.append(
                f"{len(members):>6}  {named:<14}{params:>12}{grads:>12}{opt:>12}{total:>12}"
                f"  {'equal' if same else 'DIFFERS'}"
            )
        lines += self._traffic_lines(size)
        lines.append("")
        lines.append(f"problems: {len(self.problems) or 'none'}")
        return "\n".join(lines)

    def _traffic_lines(self, size: Callable[[int], str]) -> list[str]:
        """With traces: per pipeline stage (its first traced rank), the step's FLOPs,
        activation peak and collectives per mesh dimension."""
        lines: list[str] = []
        seen: set[int] = set()
        for r in self.ranks:
            if r.trace is None or r.pp_rank in seen:
                continue
            seen.add(r.pp_rank)
            t = r.trace
            lines += [
                "",
                f"rank {r.rank} (stage {r.pp_rank}), one step: {t.flops / 1e12:.4g} TFLOP,"
                f" activations (peak, beyond what persists) {size(t.activations)}",
            ]
            for c in t.traffic:
                lines.append(
                    f"  {c.op:<15}{c.dim:<10}{c.group_size:>6} ranks {c.count:>6} calls"
                    f"  {size(c.bytes):>11}"
                )
        return lines

    def as_json(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        return {
            "world_size": self.world_size,
            "seconds": self.seconds,
            "peak_rss": self.peak_rss,
            "problems": self.problems,
            "ranks": [self._rank_json(r) for r in self.ranks],
        }

    def _rank_json(self, r: DryRank) -> dict[str, Any]:
        e = self.estimated[r.rank]
        trace = None
        if r.trace is not None:
            trace = {
                "flops": r.trace.flops,
                "flops_by_op": r.trace.flops_by_op,
                "activations": r.trace.activations,
                "traffic": [dataclasses.asdict(c) for c in r.trace.traffic],
                "p2p": [list(m) for m in r.trace.p2p],
            }
        return {
            "rank": r.rank,
            "pp_rank": r.pp_rank,
            "dp_rank": r.dp_rank,
            "tp_rank": r.tp_rank,
            "parameters": r.parameters,
            "gradients": r.gradients,
            "optimizer": r.optimizer,
            "total": self.totals(r),
            "estimate": {
                "parameters": e.parameters,
                "gradients": e.gradients,
                "optimizer": e.optimizer,
                "total": e.total,
            },
            "trace": trace,
        }


def activation_peak(config: TransformerConfig, layout: Layout) -> int:
    """The per-rank activation peak a dry run of ``layout`` reports (the largest rank's, in
    bytes): saved activations and the step's transients, at ``T / cp`` tokens a rank under
    context parallelism with the gathered keys and values (see
    :mod:`~plugintrain.estimate.activations`); what real ranks' live tensors peak at above
    what persists between steps.

    Raises:
        ValueError: If ``config`` cannot train on ``layout``.
    """
    return max(r.activations for r in estimate(config, layout).ranks)


def dry_run(
    config: TransformerConfig,
    layout: Layout,
    ranks: list[int],
    memory: int | None = None,
    trace: bool = False,
) -> DryRunReport:
    """:func:`~plugintrain.estimate.dry_run.build.dry_rank` for each of ``ranks``, against
    the layout's :func:`~plugintrain.estimate.estimate`, with the problems found: a rank
    whose bytes differ from the estimate's, one over ``memory``, an unbalanced pipeline,
    and with every rank a parameter not stepped exactly once per replica."""
    import resource
    import time

    if trace:
        untraced(layout)
    start = time.monotonic()
    built = build_ranks(config, layout, ranks, trace)  # a rank's error names the rank
    seconds = time.monotonic() - start
    by_position = {(e.pp_rank, e.dp_rank, e.cp_rank): e for e in estimate(config, layout).ranks}
    estimated = {r.rank: by_position[(r.pp_rank, r.dp_rank, r.cp_rank)] for r in built}
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = max([own, *(r.peak_rss for r in built)])  # this process's and each rank's
    problems = estimate_problems(built, estimated, memory)
    problems += balance_problems(built, config, layout)
    problems += p2p_problems(built)
    if len(built) == layout.world_size:
        problems += ownership_problems(built, layout, trainable_stages(config, layout))
    return DryRunReport(built, estimated, seconds, rss, layout.world_size, problems)
