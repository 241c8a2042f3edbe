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

import argparse
import json
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugintrain.strategies.pipeline_schedules import Simulation


def _time(text: str) -> Fraction:
    """A positive duration: ``1``, ``1.5`` or ``3/2``."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plugintrain schedule",
        description="Print a pipeline schedule and simulate it (bubble, idle, memory).",
    )
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel ranks")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (default 1)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved"),
        default=None,
        help="default: 1f1b when --vpp is 1, else interleaved",
    )
    parser.add_argument(
        "--forward-time",
        type=_time,
        default=Fraction(1),
        help="time of one micro-batch's forward on one rank (default 1)",
    )
    parser.add_argument(
        "--backward-time",
        type=_time,
        default=Fraction(2),
        help="time of one micro-batch's backward on one rank (default 2)",
    )
    parser.add_argument(
        "--forward-only", action="store_true", help="forwards alone, as in evaluation"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    measured = parser.add_argument_group(
        "measured stage times (instead of --forward-time/--backward-time)",
        "Time one micro-batch through the embedding, one block and the head of a preset on"
        " this machine and simulate the split (what layers_per_stage: auto does in fit).",
    )
    measured.add_argument("--model", default=None, help="a preset, e.g. gpt2-debug")
    measured.add_argument("--n-layer", type=int, default=None, help="blocks (default: preset's)")
    measured.add_argument("--micro-batch-size", type=int, default=1, help="sequences (default 1)")
    measured.add_argument("--seq-len", type=int, default=128, help="tokens (default 128)")
    measured.add_argument(
        "--layers-per-stage", default="auto", help="'auto' (default) or blocks per stage: 5,3"
    )
    return parser


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


def main(argv: Sequence[str]) -> int:
    """Entry point of ``plugintrain schedule``; returns 0, or 2 on bad input."""
    from plugintrain.strategies.pipeline_schedules import build_schedule, simulate

    args = _parser().parse_args(list(argv))
    name = args.schedule or ("1f1b" if args.vpp == 1 else "interleaved")
    try:
        schedule = build_schedule(name, args.pp, args.vpp, args.microbatches, args.forward_only)
    except ValueError as error:
        print(f"plugintrain schedule: error: {error}", file=sys.stderr)
        return 2
    if args.model is not None:
        return _measured(args, name)
    sim = simulate(schedule, args.forward_time, args.backward_time, rendezvous=True)
    if args.json:
        print(json.dumps(to_json(sim)))
    else:
        print(sim.grid())
        print()
        print(sim.summary())
    return 0


def _measured(args: argparse.Namespace, name: str) -> int:
    """Simulate with stage times measured on this machine; pick the split for ``auto``."""
    import torch

    from plugintrain.model_zoo import Transformer, TransformerConfig
    from plugintrain.strategies.balance import choose_split, measure_one_block, simulate_split

    try:
        config = TransformerConfig.from_name(args.model)
        n_layer = args.n_layer or config.n_layer
        if args.layers_per_stage != "auto":  # checked before anything is timed
            _counts(args.layers_per_stage, n_layer, args.pp * args.vpp)
        if args.seq_len > config.block_size:
            raise ValueError(
                f"seq_len={args.seq_len} exceeds {args.model}'s block_size={config.block_size}"
            )
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        costs = measure_one_block(
            lambda: Transformer(config.one_block()),
            config.vocab_size,
            args.micro_batch_size,
            args.seq_len,
            device,
        )
        if args.layers_per_stage == "auto":
            balance = choose_split(costs, n_layer, args.pp, args.vpp, name, args.microbatches)
            counts, sim = balance.layers_per_stage, balance.simulation
        else:
            counts = _counts(args.layers_per_stage, n_layer, args.pp * args.vpp)
            sim = simulate_split(costs, counts, args.pp, args.vpp, name, args.microbatches)
    except ValueError as error:
        print(f"plugintrain schedule: error: {error}", file=sys.stderr)
        return 2
    ms = [round(1000 * t, 3) for t in (*costs.embed, *costs.block, *costs.head)]
    if args.json:
        print(json.dumps({**to_json(sim), "layers_per_stage": list(counts), "costs_ms": ms}))
        return 0
    print(
        f"{args.model} (n_layer={n_layer}), micro-batch {args.micro_batch_size} x"
        f" {args.seq_len}, forward/backward ms: embedding {ms[0]}/{ms[1]}, block"
        f" {ms[2]}/{ms[3]}, head + loss {ms[4]}/{ms[5]}"
    )
    equal = n_layer // (args.pp * args.vpp)
    if n_layer % (args.pp * args.vpp) == 0:
        base = simulate_split(costs, [equal] * args.pp * args.vpp, args.pp, args.vpp, name,
                              args.microbatches)  # fmt: skip
        print(
            f"equal split {[equal] * args.pp * args.vpp}: step {float(base.makespan) / 1e3:.1f}"
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
