"""``plugintrain schedule``: print a pipeline schedule and simulate it.

Builds the GPipe, 1F1B or interleaved 1F1B schedule for ``--pp`` ranks, ``--vpp`` model
chunks per rank and ``--microbatches`` micro-batches
(:mod:`plugintrain.strategies.pipeline_schedules`), runs it through the symbolic
simulator and prints a time-by-rank grid followed by the bubble, each rank's idle
fraction and peak in-flight micro-batches, having also run the executor's point-to-point
batches where each send waits for its receive (NCCL; ``simulate(..., rendezvous=True)``);
``--json`` prints the same as one JSON object.
Nothing is launched: this is for choosing ``pp``, ``vpp`` and the micro-batch count.

Exit status: 0 on success, 2 on bad input (a layout the schedule cannot run).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from json import dumps
from typing import TYPE_CHECKING, Any, Literal

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import aliases

if TYPE_CHECKING:
    from plugintrain.strategies.pipeline_schedules import Simulation


def _time(option: str, text: str) -> Fraction:
    """A positive duration: ``1``, ``1.5`` or ``3/2``.

    Raises:
        ConfigError: If ``text`` is not a number > 0.
    """
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"--{option} {text!r}: not a number; give e.g. 1, 1.5 or 3/2") from None
    if value <= 0:
        raise ConfigError(f"--{option} {text}: must be > 0")
    return value


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def to_json(sim: Simulation) -> dict[str, Any]:
    """The simulation as plain JSON types; actions read ``F3`` or ``B3.1`` (chunk 1)."""
    s = sim.schedule
    return {
        "schedule": s.name,
        "pp": s.pp,
        "vpp": s.vpp,
        "microbatches": s.microbatches,
        "forward_only": s.forward_only,
        "forward_time": _number(sim.forward_time),
        "backward_time": _number(sim.backward_time),
        "actions": [[str(action) for action in actions] for actions in s.actions],
        "makespan": _number(sim.makespan),
        "bubble": float(sim.bubble_fraction),
        "bubble_exact": str(sim.bubble_fraction),
        "idle": [float(idle) for idle in sim.idle],
        "peak_in_flight": sim.peak_in_flight,
        "p2p_in_order": sim.p2p_in_order,
        "rendezvous_deadlock_free": sim.rendezvous,
        "stage_times": None
        if sim.stage_times is None
        else [[_number(f), _number(b)] for f, b in sim.stage_times],
    }


@aliases(
    forward_time="--forward-time",
    backward_time="--backward-time",
    forward_only="--forward-only",
    n_layer="--n-layer",
    micro_batch_size="--micro-batch-size",
    seq_len="--seq-len",
    layers_per_stage="--layers-per-stage",
)
def schedule(
    *,
    pp: int,
    microbatches: int,
    vpp: int = 1,
    schedule: Literal["gpipe", "1f1b", "interleaved"] | None = None,
    forward_time: str = "1",
    backward_time: str = "2",
    forward_only: bool = False,
    json: bool = False,
    model: str | None = None,
    n_layer: int | None = None,
    micro_batch_size: int = 1,
    seq_len: int = 128,
    layers_per_stage: str = "auto",
) -> int:
    """Print a pipeline schedule and simulate it (bubble, idle, memory).

    With ``--model``, the stage times are measured instead of given: one micro-batch
    through the embedding, one block and the head of a preset, timed on this machine, and
    the split simulated (what ``layers_per_stage: auto`` does in fit).

    Args:
        pp: pipeline-parallel ranks
        microbatches: micro-batches per step
        vpp: model chunks per rank
        schedule: default: 1f1b when --vpp is 1, else interleaved
        forward_time: time of one micro-batch's forward on one rank (1, 1.5 or 3/2)
        backward_time: time of one micro-batch's backward on one rank
        forward_only: forwards alone, as in evaluation
        json: print one JSON object instead
        model: measure the stage times of this preset (e.g. gpt2-debug) instead of
            --forward-time/--backward-time
        n_layer: with --model: blocks (default: the preset's)
        micro_batch_size: with --model: sequences per micro-batch
        seq_len: with --model: tokens per sequence
        layers_per_stage: with --model: 'auto' or blocks per stage, e.g. 5,3
    """
    from plugintrain.strategies.pipeline_schedules import build_schedule, simulate

    times = _time("forward-time", forward_time), _time("backward-time", backward_time)
    name = schedule or ("1f1b" if vpp == 1 else "interleaved")
    try:
        built = build_schedule(name, pp, vpp, microbatches, forward_only)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model is not None:
        layout = _Measured(model, n_layer, micro_batch_size, seq_len, layers_per_stage)
        return _measured(layout, pp, vpp, microbatches, name, json)
    sim = simulate(built, *times, rendezvous=True)
    if json:
        print(dumps(to_json(sim)))
    else:
        print(sim.grid())
        print()
        print(sim.summary())
    return 0


@dataclass(frozen=True)
class _Measured:
    """``schedule --model``'s options: what is timed."""

    model: str
    n_layer: int | None
    micro_batch_size: int
    seq_len: int
    layers_per_stage: str


def _measured(m: _Measured, pp: int, vpp: int, microbatches: int, name: str, json: bool) -> int:
    """Simulate with stage times measured on this machine; pick the split for ``auto``."""
    import torch

    from plugintrain.model_zoo import Transformer, TransformerConfig
    from plugintrain.strategies.balance import choose_split, measure_one_block, simulate_split

    try:
        config = TransformerConfig.from_name(m.model)
        n_layer = m.n_layer or config.n_layer
        if m.layers_per_stage != "auto":  # checked before anything is timed
            _counts(m.layers_per_stage, n_layer, pp * vpp)
        if m.seq_len > config.block_size:
            raise ValueError(
                f"seq_len={m.seq_len} exceeds {m.model}'s block_size={config.block_size}"
            )
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        costs = measure_one_block(
            lambda: Transformer(config.one_block()),
            config.vocab_size,
            m.micro_batch_size,
            m.seq_len,
            device,
        )
        if m.layers_per_stage == "auto":
            balance = choose_split(costs, n_layer, pp, vpp, name, microbatches)
            counts, sim = balance.layers_per_stage, balance.simulation
        else:
            counts = _counts(m.layers_per_stage, n_layer, pp * vpp)
            sim = simulate_split(costs, counts, pp, vpp, name, microbatches)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    ms = [round(1000 * t, 3) for t in (*costs.embed, *costs.block, *costs.head)]
    if json:
        print(dumps({**to_json(sim), "layers_per_stage": list(counts), "costs_ms": ms}))
        return 0
    print(
        f"{m.model} (n_layer={n_layer}), micro-batch {m.micro_batch_size} x"
        f" {m.seq_len}, forward/backward ms: embedding {ms[0]}/{ms[1]}, block"
        f" {ms[2]}/{ms[3]}, head + loss {ms[4]}/{ms[5]}"
    )
    stages = pp * vpp
    if n_layer % stages == 0:
        equal = [n_layer // stages] * stages
        base = simulate_split(costs, equal, pp, vpp, name, microbatches)
        print(
            f"equal split {equal}: step {float(base.makespan) / 1e3:.1f}"
            f" ms, bubble {float(base.bubble_fraction):.1%}"
        )
    print(
        f"layers_per_stage {list(counts)}: step {float(sim.makespan) / 1e3:.1f} ms,"
        f" bubble {float(sim.bubble_fraction):.1%} (times in microseconds below)"
    )
    print(sim.summary())
    return 0


def _counts(text: str, n_layer: int, stages: int) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != stages or sum(counts) != n_layer or min(counts) < 1:
        example = ",".join(["1"] * (stages - 1) + [str(n_layer - stages + 1)])
        raise ValueError(
            f"--layers-per-stage {text} is not {stages} positive block counts summing to"
            f" n_layer={n_layer}; pass e.g. {example}, or auto"
        )
    return counts
