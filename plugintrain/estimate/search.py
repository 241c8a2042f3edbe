"""Every rank's memory under a layout (:func:`estimate`), and the layouts of up to N devices
that fit a memory limit (:func:`fitting_layouts`; with LoRA on an unquantized base, a
layout that does not fit is proposed with its base quantized, QLoRA, where that fits)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass

from plugintrain.estimate.activations import activation_bytes
from plugintrain.estimate.layout import Layout
from plugintrain.estimate.parameters import layout_params, stage_params
from plugintrain.estimate.state import communication_bytes, training_state
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.strategies.pipeline_stages import PipelineOptions

QUANTIZE_CHOICES = ("int8", "nf4")
"""What ``--fit`` tries for LoRA's frozen base where it does not fit unquantized: the least
lossy first (int8: 8 bits and a row scale a weight; nf4: 4.127 bits, the QLoRA paper's)."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at its peak, in bytes."""

    rank: int
    """Global rank (mesh order ``pp, dp, cp, tp``; tp ranks hold the same amounts)."""
    pp_rank: int
    dp_rank: int
    parameters: int
    gradients: int
    """Gradient storage kept between steps."""
    optimizer: int
    """AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` tensors."""
    activations: int
    """Peak of saved activations and the step's transients (see :func:`activation_bytes`)."""
    communication: int
    """Gradient or parameter buffers alive only while reducing or gathering."""
    cp_rank: int = 0
    """Its rank in its context-parallel group (ZeRO shards over dp x cp)."""

    @property
    def training_state(self) -> tuple[int, int, int]:
        """Parameters, gradients and optimizer state: what persists between steps."""
        return self.parameters, self.gradients, self.optimizer

    @property
    def total(self) -> int:
        """The peak: everything above at once."""
        return sum(self.training_state) + self.activations + self.communication


@dataclass(frozen=True)
class Estimate:
    """Every rank's memory under one layout (one rank per (pp, dp, cp) position)."""

    config: TransformerConfig
    layout: Layout
    ranks: list[RankMemory]

    @property
    def peak(self) -> RankMemory:
        """The rank with the largest total."""
        return max(self.ranks, key=lambda r: r.total)

    def stage_peaks(self) -> list[RankMemory]:
        """Per pipeline stage, its rank with the largest total."""
        best: dict[int, RankMemory] = {}
        for rank in self.ranks:
            if rank.pp_rank not in best or rank.total > best[rank.pp_rank].total:
                best[rank.pp_rank] = rank
        return [best[p] for p in sorted(best)]


def estimate(config: TransformerConfig, layout: Layout) -> Estimate:
    """The memory of each (pp, dp, cp) position's rank under ``layout``.

    Raises:
        ValueError: If ``config`` cannot train on ``layout`` (:meth:`Layout.check`).
    """
    layout.check(config)
    params = layout_params(config, layout)
    ranks = []
    for pp_rank in range(layout.dims.pp):
        held = stage_params(params, config, layout, pp_rank)
        states = training_state(held, layout)
        act = activation_bytes(config, layout, pp_rank)
        comm = communication_bytes(held, layout)
        cp = layout.dims.cp
        for index, (p, g, o) in enumerate(states):  # index: dp_rank x cp + cp_rank
            dp_rank, cp_rank = divmod(index, cp)
            rank = layout.rank_of(pp_rank, dp_rank, cp_rank=cp_rank)
            ranks.append(RankMemory(rank, pp_rank, dp_rank, p, g, o, act, comm, cp_rank))
    return Estimate(config, layout, ranks)


def parse_bytes(text: str | int) -> int:
    """``80GiB``, ``80 GB``, ``1.5TiB`` or plain bytes -> bytes.

    Raises:
        ValueError: On anything else, naming the units understood.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"memory {text!r} is not a positive size; write e.g. 80GiB, 141GB or 85899345920"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def candidate_layouts(
    config: TransformerConfig, gpus: int, base: Layout, microbatches: int | None = None
) -> Iterator[Layout]:
    """Every layout of up to ``gpus`` devices the model can train on, with ``base``'s
    batch, precision, recomputation, LoRA and context parallelism (``base``'s cp, kept):
    dp x tp x pp over each device count, ZeRO 0-2 (and FSDP2 without a pipeline) when
    dp x cp > 1, sequence parallelism whenever tp > 1; a
    pipeline cuts each batch into ``microbatches`` (default: pp; where its schedule cannot
    run that many, the layout is left out)."""
    cp = base.dims.cp
    for world in range(1, gpus // cp + 1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                shards = dp * cp > 1
                stages = (0, 1, 2, 3) if shards and pp == 1 else (0, 1, 2) if shards else (0,)
                for zero in stages:
                    strategy = "single" if world * cp == 1 else "hybrid"
                    try:
                        layout = dataclasses.replace(base, strategy="hybrid").replace(
                            dp=dp, tp=tp, sp=tp > 1, pp=pp, vpp=1, zero_stage=zero
                        )
                        layout = dataclasses.replace(layout, strategy=strategy)
                        if pp > 1 and microbatches is not None:
                            pipeline = PipelineOptions.resolve(layout.dims, None, microbatches)
                            layout = dataclasses.replace(layout, pipeline=pipeline)
                        layout.check(config)
                    except ValueError:
                        continue
                    yield layout


def fitting_layouts(
    config: TransformerConfig,
    gpus: int,
    memory: int,
    base: Layout,
    microbatches: int | None = None,
) -> list[Estimate]:
    """The layouts of up to ``gpus`` devices whose largest rank needs at most ``memory``
    bytes (:func:`candidate_layouts`), fewest devices first, then least memory per device.

    With LoRA on an unquantized base (``base.lora.quantize`` None), a layout that does not
    fit as it is is estimated again with its frozen base quantized, as each of
    :data:`QUANTIZE_CHOICES` in turn (tensor parallelism cannot hold a quantized base, so
    only where tp is 1), and proposed with the first that fits: its ``layout.quantize``
    names what to set as the LoRA callback's ``quantize``. A layout that fits unquantized
    is proposed unquantized. A base quantized already is kept as it is."""
    fits = []
    for layout in candidate_layouts(config, gpus, base, microbatches):
        result = _first_fit(config, layout, memory)
        if result is not None:
            fits.append(result)
    return sorted(fits, key=lambda e: (e.layout.world_size, e.peak.total))


def _first_fit(config: TransformerConfig, layout: Layout, memory: int) -> Estimate | None:
    """``layout``'s estimate if it fits ``memory``, else its first quantized variant's
    that does (see :func:`fitting_layouts`); None if none fits."""
    variants = [layout]
    if layout.lora is not None and layout.quantize is None and layout.dims.tp == 1:
        variants += [
            dataclasses.replace(layout, lora=dataclasses.replace(layout.lora, quantize=kind))
            for kind in QUANTIZE_CHOICES
        ]
    for variant in variants:
        result = estimate(config, variant)
        if result.peak.total <= memory:
            return result
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
