"""Dry runs: one CPU process plays rank R of N through torch's fake process-group backend.

Where :func:`~plugintrain.estimate.estimate` computes each rank's bytes from the model's
shapes, a dry run builds rank R as a launch would, on the real code path: the layout's
DeviceMesh over N ranks (``ParallelDims.build_mesh``), the model built shard-first on the
meta device, this rank's pipeline stages split off, the TP(+SP) plan, expert placement,
FSDP2 or the gradient engine's buckets and shards, the optimizer attached to them, then
one optimizer step whose state the optimizer creates itself. Nothing is allocated (every
tensor stays on the meta device) and no collective moves data (the ``fake`` backend
returns at once), so a rank of a 405B model on 1,024 ranks takes seconds and a few
hundred MB. The bytes reported are read from the tensors this rank holds, counted by
distinct storage as the real-rank tests count them
(``tests/distributed/test_estimate_distributed.py``).

What a real launch would refuse (a degree that does not divide, heads that tp does not
split, layers that do not split into the stages, experts that ep does not divide) is
refused here by the same checks, as one line naming the rank and the value.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig


@dataclass(frozen=True)
class DryRank:
    """What one rank of a dry run holds after its first optimizer step, in bytes."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    parameters: int
    """The distinct storages behind this rank's parameters (a DTensor by its local shard;
    the gradient engine's flat, padded buckets)."""
    gradients: int
    """Gradient storage kept between steps (the engine's buckets or shards; ``.grad``)."""
    optimizer: int
    """The optimizer's state tensors after one step."""
    layers: tuple[str, ...]
    """The transformer blocks this rank holds (its pipeline stages')."""
    owned: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Elements of each whole-model parameter (by its canonical name: a tied head by the
    embedding's) that this rank's optimizer steps."""
    copies: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """How many ranks may step the same elements of each parameter held here, besides
    pipeline stages holding a tied weight: the tp ranks holding the same piece, times the
    dp replicas at ZeRO stage 0 (the expert-data-parallel ones for an expert weight)."""
    full: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Each parameter's whole-model element count."""


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as torch's ``fake`` backend, rank ``rank`` of
    ``world_size`` (collectives return at once, moving nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_rank(config: TransformerConfig, layout: Layout, rank: int) -> DryRank:
    """Build global rank ``rank`` of ``layout`` on the meta device (see the module) and
    take one optimizer step; what it holds.

    Raises:
        ValueError: One line naming the rank and the value, where a launch would fail.
    """
    with fake_world(rank, layout.world_size):
        try:
            return _build_rank(config, layout, rank)
        except ValueError as error:
            raise ValueError(f"rank {rank}: {error}") from None


def _build_rank(config: TransformerConfig, layout: Layout, rank: int) -> DryRank:
    from plugintrain.model_zoo import CausalLM
    from plugintrain.strategies.parallel_plan import (
        build_engine,
        check_model_fits,
        prepare_model,
    )
    from plugintrain.strategies.pipeline_runtime import chunk_partition
    from plugintrain.strategies.tied import TiedParameters

    dims = _strategy_dims(layout)
    mesh = dims.build_mesh("cpu")
    dtypes = _dtypes(layout.precision)
    module = CausalLM(config)
    with torch.device("meta"), _default_dtype(dtypes.params):
        module.configure_model()
    if layout.lora is not None:
        _inject_lora(module, layout)
    check_model_fits(module, dims, layout.pipeline, strategy_name="dry run")
    fsdp = dims.fsdp_enabled
    stages = prepare_model(
        module, dims, layout.pipeline, mesh, torch.device("meta"), True, layout.blocks,
        dtypes if fsdp else None,
    )  # fmt: skip
    engine = None
    if layout.stage is not None:
        tied = TiedParameters.of(module)
        partition = chunk_partition(module, stages, tied) if stages is not None else None
        engine = build_engine(
            module, dims, mesh, layout.bucket_size_mb, True, False, partition
        )  # fmt: skip
    optimizer = module.optimizer(module._param_groups())
    if engine is not None:
        engine.attach(optimizer)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    _one_step(optimizer, stepped, engine)
    params = list(module.parameters())
    buckets = engine._layout.buckets if engine is not None else []
    engine_grads = [t for b in buckets for t in (b.grads, b.shard_grads, b.shard_pending)]
    grads = [p.grad for p in params + stepped] + engine_grads
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    coords = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names or ()
    where = dict(zip(names, coords, strict=True))
    dp_rank = _dp_rank(where, mesh)
    layers = tuple(
        name for name, _ in module.named_modules() if name.count(".") == 2 and ".layers." in name
    )
    owned, copies, full = _ownership(module, stepped, engine, dims)
    return DryRank(
        rank=rank, pp_rank=where.get("pp", 0), dp_rank=dp_rank, tp_rank=where.get("tp", 0),
        parameters=storage_bytes(params), gradients=storage_bytes(grads),
        optimizer=storage_bytes(states), layers=layers, owned=owned, copies=copies, full=full,
    )  # fmt: skip


def _ownership(
    module: Any, stepped: list[Tensor], engine: Any, dims: Any
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """:attr:`DryRank.owned`, :attr:`DryRank.copies` and :attr:`DryRank.full`."""
    from plugintrain.strategies.expert_parallel import expert_layers
    from plugintrain.strategies.parallel_plan import tp_replicas

    canonical = {b: a for a, b in module.model.tied_parameters()}
    names: dict[int, str] = {}
    for name, param in module.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), canonical.get(name, name))
    experts = {
        id(p) for _, layer in expert_layers(module) for p in layer.experts.parameters()
    } if dims.ep > 1 else set()  # fmt: skip
    owned: dict[str, int] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for shard in stepped:
        param = engine.parameter_of(shard) if engine is not None else shard
        name = names[id(param)]
        local = shard._local_tensor if isinstance(shard, DTensor) else shard
        owned[name] = owned.get(name, 0) + local.numel()
        replicas = dims.dp // dims.ep if id(param) in experts else dims.dp
        copies[name] = tp_replicas(param, dims.tp) * (replicas if dims.zero_stage == 0 else 1)
        full[name] = param.numel()
    return owned, copies, full


def _strategy_dims(layout: Layout) -> Any:
    """The degrees the layout's strategy builds its mesh with: data parallelism alone
    (``zero1``, ``zero2``, ``ddp_bucketed``) is the hybrid mesh with dp = world."""
    return dataclasses.replace(layout.dims)


def _one_step(optimizer: torch.optim.Optimizer, stepped: list[Tensor], engine: Any) -> None:
    """The optimizer's first step, which creates its state as a real step does. With the
    engine, its own end of backward: every bucket reduced (a gradient that never arrived
    counts as zero), the owned slices published as the shards' ``.grad``; without, a
    ``.grad`` of each parameter's shape (what backward leaves, and Lightning keeps)."""
    if engine is not None:
        engine.finish_grad_sync()
    else:
        for p in stepped:
            p.grad = torch.zeros_like(p)
    optimizer.step()


def _dp_rank(where: dict[str, int], mesh: Any) -> int:
    if "dp" in where:
        return where["dp"]
    if "edp" in where:  # expert parallelism: dp = edp x ep
        return where["edp"] * mesh["ep"].size() + where["ep"]
    return 0


def storage_bytes(tensors: list[Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor by its local shard),
    on any device, the meta device included (a storage is told apart by its C++ object,
    which views share)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _dtypes(precision: str) -> Any:
    from plugintrain.precision_plugins import precision_dtypes

    class _Named:
        def __init__(self, name: str) -> None:
            self.precision = name

    return precision_dtypes(_Named(precision))  # type: ignore[arg-type]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _inject_lora(module: Any, layout: Layout) -> None:
    from plugintrain.model_zoo.lora import inject

    assert layout.lora is not None
    inject(module.model, layout.lora)


def rank_of(layout: Layout, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
    """The global rank at mesh coordinates ``(pp, dp, tp)`` (tp innermost; with experts,
    ``dp = edp x ep`` flattened the same way)."""
    dims = layout.dims
    return (pp_rank * dims.dp + dp_rank) * dims.tp + tp_rank


def sample_ranks(layout: Layout) -> list[int]:
    """One rank of every kind: per pipeline stage, the first and last dp rank (ZeRO's
    padding lands on the last) and the first and last tp rank; every rank of a small
    layout."""
    dims = layout.dims
    picked = {
        rank_of(layout, pp, dp, tp)
        for pp in range(dims.pp)
        for dp in sorted({0, dims.dp - 1})
        for tp in sorted({0, dims.tp - 1})
    }
    return sorted(picked)


def ownership_problems(ranks: list[DryRank], layout: Layout) -> list[str]:
    """Every parameter's elements stepped exactly once per replica the layout keeps (over
    all ranks: call with every rank): one line per parameter that is not."""
    if len(ranks) != layout.world_size:
        raise ValueError("the ownership check needs every rank (--ranks all)")
    stepped: dict[str, int] = {}
    stages: dict[str, set[int]] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for r in ranks:
        for name, n in r.owned.items():
            stepped[name] = stepped.get(name, 0) + n
            stages.setdefault(name, set()).add(r.pp_rank)
            copies[name], full[name] = r.copies[name], r.full[name]
    problems = []
    for name in sorted(stepped):
        expected = full[name] * copies[name] * len(stages[name])
        if stepped[name] != expected:
            problems.append(
                f"parameter {name}: {stepped[name]} elements stepped over all ranks, expected"
                f" {expected} ({full[name]} x {copies[name]} replicas x {len(stages[name])}"
                " stages)"
            )
    return problems


def balance_problems(ranks: list[DryRank], limit: float = 1.5) -> list[str]:
    """A pipeline stage holding over ``limit`` x the parameter bytes of the lightest stage
    (it sets the pace of every step): one line naming it and the fix."""
    per_stage: dict[int, int] = {}
    for r in ranks:
        per_stage[r.pp_rank] = max(per_stage.get(r.pp_rank, 0), r.parameters)
    if len(per_stage) < 2:
        return []
    heavy = max(per_stage, key=per_stage.__getitem__)
    light = min(per_stage, key=per_stage.__getitem__)
    ratio = per_stage[heavy] / max(per_stage[light], 1)
    if ratio <= limit:
        return []
    return [
        f"pipeline stage {heavy} holds {ratio:.2f}x the parameters of stage {light}"
        f" ({per_stage[heavy]} vs {per_stage[light]} bytes per rank); move blocks off it with"
        " --layers_per_stage"
    ]


def parse_ranks(text: str, layout: Layout) -> list[int]:
    """``--ranks``: ``sample`` (:func:`sample_ranks`), ``all``, or comma-separated ranks."""
    if text == "all":
        return list(range(layout.world_size))
    if text == "sample":
        return sample_ranks(layout)
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--ranks={text!r}: give sample, all or ranks like 0,5,1023") from None
    bad = [r for r in ranks if not 0 <= r < layout.world_size]
    if bad:
        raise ValueError(
            f"--ranks={text!r}: rank {bad[0]} is not in 0..{layout.world_size - 1}"
            f" (world size {layout.world_size})"
        )
    return ranks


@dataclass
class DryRunReport:
    """A dry run's ranks, the estimate's figures for them, and the problems found."""

    ranks: list[DryRank]
    estimated: dict[int, tuple[int, int, int, int]]
    """Rank -> the estimate's parameters, gradients, optimizer and total bytes."""
    seconds: float
    peak_rss: int
    problems: list[str]

    def totals(self, r: DryRank) -> int:
        """A rank's dry-run training state plus the estimate's activations and buffers."""
        est = self.estimated[r.rank]
        return r.parameters + r.gradients + r.optimizer + est[3] - sum(est[:3])

    def table(self, size: Any) -> str:
        """Ranks with the same figures on one row, with their count and stages."""
        rows: dict[tuple, list[DryRank]] = {}
        for r in self.ranks:
            held = (r.parameters, r.gradients, r.optimizer)
            rows.setdefault((*held, held == self.estimated[r.rank][:3]), []).append(r)
        lines = [
            f"dry run of {len(self.ranks)} of {self.world_size} ranks (fake process group,"
            f" meta tensors): {self.seconds:.1f} s, peak RSS {size(self.peak_rss)}",
            "",
            f"{'ranks':>6}  {'stages':<14}{'parameters':>12}{'gradients':>12}{'optimizer':>12}"
            f"{'total':>12}  estimate",
        ]
        for (params, grads, opt, same), members in rows.items():
            stages = sorted({m.pp_rank for m in members})
            named = ",".join(map(str, stages)) if len(stages) <= 4 else f"{len(stages)} stages"
            lines.append(
                f"{len(members):>6}  {named:<14}{size(params):>12}{size(grads):>12}"
                f"{size(opt):>12}{size(self.totals(members[0])):>12}"
                f"  {'equal' if same else 'DIFFERS'}"
            )
        lines.append("")
        lines.append(f"problems: {len(self.problems) or 'none'}")
        return "\n".join(lines)

    world_size: int = 0

    def as_json(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        return {
            "world_size": self.world_size, "seconds": self.seconds, "peak_rss": self.peak_rss,
            "problems": self.problems,
            "ranks": [
                {"rank": r.rank, "pp_rank": r.pp_rank, "dp_rank": r.dp_rank,
                 "tp_rank": r.tp_rank, "parameters": r.parameters, "gradients": r.gradients,
                 "optimizer": r.optimizer, "total": self.totals(r),
                 "estimate": dict(zip(("parameters", "gradients", "optimizer", "total"),
                                      self.estimated[r.rank], strict=True))}
                for r in self.ranks
            ],
        }  # fmt: skip


def dry_run(
    config: TransformerConfig,
    layout: Layout,
    ranks: list[int],
    expected: Any,
    memory: int | None = None,
) -> DryRunReport:
    """:func:`dry_rank` for each of ``ranks``, against ``expected`` (the layout's
    :class:`~plugintrain.estimate.Estimate`), with the problems found: a rank whose bytes
    differ from the estimate's, one over ``memory``, an unbalanced pipeline, and with every
    rank a parameter not stepped exactly once per replica."""
    import resource
    import time

    start = time.monotonic()
    built = [dry_rank(config, layout, rank) for rank in ranks]
    seconds = time.monotonic() - start
    by_position = {(e.pp_rank, e.dp_rank): e for e in expected.ranks}
    estimated = {}
    for r in built:
        e = by_position[(r.pp_rank, r.dp_rank)]
        estimated[r.rank] = (e.parameters, e.gradients, e.optimizer, e.total)
    report = DryRunReport(
        built, estimated, seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        [], layout.world_size,
    )  # fmt: skip
    problems = report.problems
    for r in built:
        held = (r.parameters, r.gradients, r.optimizer)
        if held != estimated[r.rank][:3]:
            problems.append(
                f"rank {r.rank}: holds parameters/gradients/optimizer {held} bytes, the"
                f" estimate says {estimated[r.rank][:3]}"
            )
        if memory is not None and report.totals(r) > memory:
            problems.append(
                f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}, tp {r.tp_rank}) needs"
                f" {report.totals(r)} bytes > --memory {memory}; list layouts that fit with"
                f" --fit {memory}"
            )
    problems += balance_problems(built)
    if len(built) == layout.world_size:
        problems += ownership_problems(built, layout)
    return report
