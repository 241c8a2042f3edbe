"""Profile-guided pipeline balancing: ``layers_per_stage: auto``.

An equal split of the blocks leaves the last stage slower than the others: it also runs
the final norm, the LM head and the loss, which at a large vocabulary cost several blocks
(the embedding lookup on the first stage costs little). :func:`measure_costs` times one
micro-batch's forward and backward through the embedding, one block and the head on this
device, in the run's shapes and compute dtype; :func:`choose_split` then picks the
contiguous split whose simulated step (:func:`~plugintrain.strategies.pipeline_schedules.
simulate` with these per-stage times) is shortest.

Every rank must cut the model the same way: at setup the strategy uses global rank 0's
figures (:mod:`~plugintrain.strategies.auto_split`). Nothing here needs Lightning, so
``plugintrain schedule --model`` measures without it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plugintrain.core.profiling import device_seconds
from plugintrain.strategies.pipeline_schedules import Simulation, build_schedule, simulate

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision

MEASURED_TOKENS = 8192
"""Most tokens timed through the head at once (the micro-batch's costs are scaled from them)."""
EXHAUSTIVE_ACTIONS = 200_000
"""Every split is simulated while splits x scheduled actions stay under this (about a
second); beyond, a local search from the split that best evens out stage times (a stage
boundary moved one block at a time while the simulated step shortens)."""


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of one micro-batch's forward and backward through each part of the model.

    Dense models: every block costs the same, so one block is measured.
    """

    embed: tuple[float, float]
    block: tuple[float, float]
    head: tuple[float, float]
    """Final norm, output projection and loss."""

    def stage_times(self, counts: Sequence[int]) -> list[tuple[float, float]]:
        """Forward and backward seconds of each virtual stage holding ``counts`` blocks."""
        times = []
        for stage, n in enumerate(counts):
            fwd, bwd = n * self.block[0], n * self.block[1]
            if stage == 0:
                fwd, bwd = fwd + self.embed[0], bwd + self.embed[1]
            if stage == len(counts) - 1:
                fwd, bwd = fwd + self.head[0], bwd + self.head[1]
            times.append((fwd, bwd))
        return times

    def scaled(self, factor: float) -> LayerCosts:
        """Every cost times ``factor`` (another micro-batch size)."""
        return LayerCosts(*(tuple(factor * t for t in part) for part in self._parts()))

    def _parts(self) -> tuple[tuple[float, float], ...]:
        return (self.embed, self.block, self.head)

    def as_tensor(self) -> Tensor:
        return torch.tensor([*self.embed, *self.block, *self.head], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: Tensor) -> LayerCosts:
        v = [float(x) for x in values]
        return cls(embed=(v[0], v[1]), block=(v[2], v[3]), head=(v[4], v[5]))


@dataclass(frozen=True)
class Balance:
    """The chosen split and what the simulator predicts for it."""

    layers_per_stage: tuple[int, ...]
    simulation: Simulation
    step_seconds: float
    """Simulated step: the schedule's makespan with the measured per-stage times."""
    equal_step_seconds: float | None
    """The same for the equal split (None when the blocks do not divide equally)."""


def simulate_split(
    costs: LayerCosts, counts: Sequence[int], pp: int, vpp: int, schedule: str, microbatches: int
) -> Simulation:
    """The schedule simulated with the per-stage times of a split."""
    plan = build_schedule(schedule, pp, vpp, microbatches)
    micros = [(_micros(f), _micros(b)) for f, b in costs.stage_times(counts)]
    return simulate(plan, stage_times=micros)


def _micros(seconds: float) -> Fraction:
    """Whole microseconds (at least one): exact, cheap Fraction arithmetic in the simulator."""
    return Fraction(max(1, round(seconds * 1e6)))


def choose_split(
    costs: LayerCosts, n_layer: int, pp: int, vpp: int, schedule: str, microbatches: int
) -> Balance:
    """The contiguous split of ``n_layer`` blocks into ``pp * vpp`` stages (each at least
    one block) with the shortest simulated step; ties go to the split nearest equal."""
    stages = pp * vpp
    if n_layer < stages:
        raise ValueError(
            f"layers_per_stage=auto: {n_layer} blocks cannot fill pipeline_parallel={pp} x"
            f" virtual_pipeline_parallel={vpp} = {stages} stages of at least one block"
        )

    def step(counts: Sequence[int]) -> Fraction:
        return simulate_split(costs, counts, pp, vpp, schedule, microbatches).makespan

    actions = 2 * stages * microbatches
    if math.comb(n_layer - 1, stages - 1) * actions <= EXHAUSTIVE_ACTIONS:
        candidates: Iterator[tuple[int, ...]] = _compositions(n_layer, stages)
        best = min(candidates, key=lambda c: (step(c), _unevenness(c)))
    else:
        best = _local_search(_even_times(costs, n_layer, stages), step)
    equal = None
    if n_layer % stages == 0:
        equal = float(step([n_layer // stages] * stages)) / 1e6
    simulation = simulate_split(costs, best, pp, vpp, schedule, microbatches)
    return Balance(tuple(best), simulation, float(simulation.makespan) / 1e6, equal)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def _unevenness(counts: Sequence[int]) -> int:
    return max(counts) - min(counts)


def _even_times(costs: LayerCosts, n_layer: int, stages: int) -> list[int]:
    """The split whose slowest stage (forward + backward) is fastest: a greedy start."""

    def worst(counts: Sequence[int]) -> float:
        return max(f + b for f, b in costs.stage_times(counts))

    counts = [n_layer // stages] * stages
    for i in range(n_layer % stages):
        counts[i] += 1
    improved = True
    while improved:
        improved = False
        for src in range(stages):
            for dst in range(stages):
                if src == dst or counts[src] == 1:
                    continue
                moved = list(counts)
                moved[src] -= 1
                moved[dst] += 1
                if worst(moved) < worst(counts):
                    counts, improved = moved, True
    return counts


def _local_search(start: list[int], step: Callable[[Sequence[int]], Fraction]) -> tuple[int, ...]:
    """Move one block across one stage boundary at a time while the step shortens."""
    best, best_time = tuple(start), step(start)
    improved = True
    while improved:
        improved = False
        for boundary in range(len(best) - 1):
            for delta in (-1, 1):
                counts = list(best)
                counts[boundary] += delta
                counts[boundary + 1] -= delta
                if min(counts) < 1:
                    continue
                t = step(counts)
                if t < best_time:
                    best, best_time, improved = tuple(counts), t, True
    return best


def measure_costs(
    model: torch.nn.Module,
    micro_batch: int,
    seq_len: int,
    vocab_size: int,
    forward_context: Callable[[], AbstractContextManager] = nullcontext,
    repeats: int = 3,
) -> LayerCosts:
    """Time one micro-batch ``(micro_batch, seq_len)`` through ``model``'s embedding, its
    first block and its head + loss, forward and backward apart (median of ``repeats``
    after one warm-up).

    ``model`` is a one-block model of the run's architecture (a
    :class:`~plugintrain.core.contracts.StagedModel`), materialized on the run's device:
    never the whole model, so this is as cheap for 8B as for the debug models.
    ``forward_context``: the run's precision plugin's (autocast for mixed precision).
    """
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq_len, device=device)
    key = next(iter(model.layers.keys()))
    parts: list[Callable[[Tensor], Tensor]] = [
        lambda _: model.embed(x, positions),
        lambda h: model.run_layers(h, [key], positions),
        lambda h: F.cross_entropy(model.head(h).float().flatten(0, 1), y.flatten()),
    ]
    samples: list[list[tuple[float, float]]] = [[] for _ in parts]
    for _ in range(repeats + 1):
        for index, seconds in enumerate(_time_parts(parts, device, forward_context)):
            samples[index].append(seconds)
    medians = [
        (statistics.median(f for f, _ in s[1:]), statistics.median(b for _, b in s[1:]))
        for s in samples
    ]
    model.zero_grad(set_to_none=True)
    return LayerCosts(embed=medians[0], block=medians[1], head=medians[2])


def _time_parts(
    parts: list[Callable[[Tensor], Tensor]],
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager],
) -> list[tuple[float, float]]:
    """Forward each part on the previous one's (detached) output, then backward each."""
    inputs: list[Tensor | None] = [None]
    outputs: list[Tensor] = []
    forward: list[float] = []
    for part in parts:
        start = device_seconds(device)
        with forward_context():
            out = part(inputs[-1])  # type: ignore[arg-type]
        forward.append(device_seconds(device) - start)
        outputs.append(out)
        inputs.append(out.detach().requires_grad_(True))
    backward: list[float] = [0.0] * len(parts)
    grad: Tensor | None = None
    for index in reversed(range(len(parts))):
        start = device_seconds(device)
        outputs[index].backward(grad)
        backward[index] = device_seconds(device) - start
        grad = inputs[index].grad if inputs[index] is not None else None
    return list(zip(forward, backward, strict=True))


def measure_one_block(
    build: Callable[[], nn.Module],
    vocab_size: int,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    precision_plugin: Precision | None = None,
) -> LayerCosts:
    """:func:`measure_costs` on the one-block model ``build()`` makes on ``device`` (in the
    precision plugin's parameter dtype, run under its forward context). The global random
    state is left as it was: the real model's weights and data order do not depend on
    whether the split was measured."""
    devices = [device] if device.type == "cuda" else []
    init = precision_plugin.tensor_init_context if precision_plugin else nullcontext
    forward = precision_plugin.forward_context if precision_plugin else nullcontext
    with torch.random.fork_rng(devices=devices):
        with torch.device(device), init():
            model = build()
        return measure_costs(model, micro_batch, seq_len, vocab_size, forward)
