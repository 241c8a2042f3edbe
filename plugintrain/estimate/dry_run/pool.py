"""Building many dry-run ranks: each in a process of its own, forked from a fork server that
imported torch and the strategies once."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from plugintrain.estimate.dry_run.build import DryRank, dry_rank
from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.utils.flop_counter",
    "lightning.pytorch",
    "plugintrain.model_zoo.lm",
    "plugintrain.strategies.hybrid",
    "plugintrain.strategies.parallel_plan",
    "plugintrain.strategies.pipeline_runtime",
    "plugintrain.precision_plugins",
    "plugintrain.core.memory",
    "plugintrain.estimate.search",
    "plugintrain.estimate.dry_run",
]
"""What the fork server imports once, so that no rank's process imports it again."""


def build_ranks(
    config: TransformerConfig,
    layout: Layout,
    ranks: list[int],
    trace: bool = False,
    workers: int | None = None,
) -> list[DryRank]:
    """:func:`~plugintrain.estimate.dry_run.build.dry_rank` for each of ``ranks``, each in a
    process of its own (nothing a rank's world leaves behind, process groups and meshes,
    reaches the next, and no process's memory grows with the world), ``workers`` at a time
    (default: the CPU cores, at most 8). The processes are forked from a fork server that
    imported torch and the strategies once (never from this process, which may have
    threads).

    Raises:
        ValueError: The first rank's one-line error, in rank order (a rank that fails in
            another way, or whose process dies, too).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    workers = min(workers or min(8, os.cpu_count() or 1), len(ranks))
    context = multiprocessing.get_context("forkserver")
    _preload(context, PRELOAD)
    jobs = [(config, layout, r, trace) for r in ranks]
    try:
        with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
            results = list(pool.map(_rank_or_error, *zip(*jobs, strict=True), chunksize=1))
    except BrokenProcessPool:
        raise ValueError(
            "a dry-run rank's process died (out of memory?); run fewer at once with a"
            " smaller --ranks list"
        ) from None
    for result in results:
        if isinstance(result, str):
            raise ValueError(result)
    return results


def _preload(context: Any, modules: list[str]) -> None:
    """Add ``modules`` to what the fork server imports when it starts (keeping what this
    process asked for before; nothing once it runs). Only a speed-up: skipped if this
    Python's fork server keeps its state elsewhere."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    asked = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    context.set_forkserver_preload(list(dict.fromkeys([*asked, *modules])))


def _rank_or_error(
    config: TransformerConfig, layout: Layout, rank: int, trace: bool
) -> DryRank | str:
    """A worker's :func:`~plugintrain.estimate.dry_run.build.dry_rank` (with its process's
    peak RSS); its error as one line (sent back as a string): a launch's refusal as it is,
    anything else with its type."""
    import resource

    try:
        built = dry_rank(config, layout, rank, trace)
    except ValueError as error:
        return str(error)
    except Exception as error:  # a kernel or DTensor rule the meta device lacks
        text = str(error).splitlines()[0][:300] if str(error) else ""
        return f"rank {rank}: {type(error).__name__}: {text} (the dry run cannot build it)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dataclasses.replace(built, peak_rss=rss)
