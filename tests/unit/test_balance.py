"""``layers_per_stage: auto``: the split it picks, the costs it measures, the CLI view.

The choice is checked against GPipe's closed-form step time with unequal stages
(``sum_s F_s + (m - 1) max_s F_s`` plus the same for backward: the pipeline fills, the
slowest stage sets the pace, it drains), which owes nothing to the simulator.
"""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
import torch

from plugintrain.cli import main
from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.strategies import ParallelDims
from plugintrain.strategies.balance import (
    LayerCosts,
    choose_split,
    measure_one_block,
    simulate_split,
)
from plugintrain.strategies.pipeline_schedules import build_schedule, simulate
from plugintrain.strategies.pipeline_stages import PipelineOptions, check_layers


def _gpipe_step(costs: LayerCosts, counts: tuple[int, ...], m: int) -> float:
    times = costs.stage_times(counts)
    forward = [f for f, _ in times]
    backward = [b for _, b in times]
    return sum(forward) + (m - 1) * max(forward) + sum(backward) + (m - 1) * max(backward)


def _splits(n: int, parts: int) -> list[tuple[int, ...]]:
    cuts = itertools.combinations(range(1, n), parts - 1)
    return [tuple(b - a for a, b in zip((0, *c), (*c, n), strict=True)) for c in cuts]


HEAVY_HEAD = LayerCosts(embed=(0.0005, 0.001), block=(0.010, 0.020), head=(0.040, 0.060))
CHEAP_HEAD = LayerCosts(embed=(0.0005, 0.001), block=(0.010, 0.020), head=(0.0005, 0.001))


@pytest.mark.parametrize("costs", [HEAVY_HEAD, CHEAP_HEAD], ids=["heavy head", "cheap head"])
@pytest.mark.parametrize(("n_layer", "pp", "m"), [(8, 2, 4), (12, 3, 6), (10, 4, 8)])
def test_gpipe_split_minimizes_the_closed_form_step(
    costs: LayerCosts, n_layer: int, pp: int, m: int
) -> None:
    balance = choose_split(costs, n_layer, pp, 1, "gpipe", m)
    best = min(_gpipe_step(costs, s, m) for s in _splits(n_layer, pp))
    chosen = _gpipe_step(costs, balance.layers_per_stage, m)
    assert chosen == pytest.approx(best, rel=1e-4)
    assert balance.step_seconds == pytest.approx(chosen, rel=1e-4)


def test_a_heavy_head_moves_blocks_off_the_last_stage() -> None:
    for schedule, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        balance = choose_split(HEAVY_HEAD, 8, 2, vpp, schedule, 4)
        counts = balance.layers_per_stage
        assert counts[-1] < 8 // (2 * vpp) and sum(counts) == 8, (schedule, counts)
        assert balance.equal_step_seconds is not None
        assert balance.step_seconds < balance.equal_step_seconds, schedule
    cheap = choose_split(CHEAP_HEAD, 8, 2, 1, "1f1b", 4)
    assert cheap.layers_per_stage == (4, 4)  # nothing to balance: the equal split


def test_a_large_search_stays_fast_and_no_worse_than_equal() -> None:
    # 32 blocks over 8 stages: 2.6 million splits, searched locally instead.
    balance = choose_split(HEAVY_HEAD, 32, 8, 1, "1f1b", 16)
    assert sum(balance.layers_per_stage) == 32 and min(balance.layers_per_stage) >= 1
    assert balance.equal_step_seconds is not None
    assert balance.step_seconds <= balance.equal_step_seconds
    assert balance.layers_per_stage[-1] < 4


def test_per_stage_times_equal_to_the_uniform_ones_simulate_alike() -> None:
    schedule = build_schedule("interleaved", 2, 2, 4)
    uniform = simulate(schedule, 2, 4)  # per rank: each of 2 chunks takes 1 and 2
    per_stage = simulate(schedule, stage_times=[(1, 2)] * 4)
    assert per_stage.makespan == uniform.makespan
    assert [[(t.start, t.end) for t in r] for r in per_stage.timeline] == [
        [(t.start, t.end) for t in r] for r in uniform.timeline
    ]
    with pytest.raises(ValueError, match="stage_times has 3 entries for 4 stages"):
        simulate(schedule, stage_times=[(1, 2)] * 3)


def test_stage_times_follow_the_split() -> None:
    sim = simulate_split(HEAVY_HEAD, (5, 3), 2, 1, "gpipe", 1)
    ends = [slot.end for rank in sim.timeline for slot in rank]
    # One micro-batch: every part runs once, one after another.
    total = sum(f + b for f, b in HEAVY_HEAD.stage_times((5, 3)))
    assert float(max(ends)) / 1e6 == pytest.approx(total, rel=1e-4)
    assert sim.stage_times is not None and sim.stage_times[1][0] == Fraction(70_000)


def test_measuring_leaves_the_random_state_and_builds_one_block() -> None:
    config = TransformerConfig.from_name("llama3-debug", vocab_size=512)
    before = torch.get_rng_state()
    costs = measure_one_block(
        lambda: Transformer(config.one_block()), config.vocab_size, 2, 32, torch.device("cpu")
    )
    assert torch.equal(torch.get_rng_state(), before)  # the run's init and data order
    assert all(t > 0 for part in (costs.embed, costs.block, costs.head) for t in part)


def test_auto_is_checked_before_launch() -> None:
    check_layers(8, 2, 2, "auto")
    with pytest.raises(ValueError, match="needs a block per stage: n_layer=3 <"):
        check_layers(3, 2, 2, "auto")
    with pytest.raises(ValueError, match="layers_per_stage='even' is neither 'auto'"):
        PipelineOptions.resolve(_dims(pp=2), layers_per_stage="even")
    assert PipelineOptions.resolve(_dims(pp=2), layers_per_stage="auto").layers_per_stage == "auto"


def _dims(pp: int) -> ParallelDims:
    return ParallelDims(pipeline_parallel=pp)


def test_schedule_tool_shows_the_measured_split(capsys: pytest.CaptureFixture) -> None:
    args = ["schedule", "--pp", "2", "--microbatches", "4", "--model", "gpt2-debug",
            "--n-layer", "4", "--micro-batch-size", "1", "--seq-len", "16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gpt2-debug (n_layer=4), micro-batch 1 x 16" in out
    assert "equal split [2, 2]: step" in out and "layers_per_stage [" in out
    assert main([*args, "--layers-per-stage", "3,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "plugintrain schedule: error: --layers-per-stage 3,2 is not 2 positive block counts"
        " summing to n_layer=4; pass e.g. 1,3, or auto"
    )
    assert main([*args, "--layers-per-stage", "1,3", "--json"]) == 0  # the hint works
    shown = json.loads(capsys.readouterr().out)
    assert shown["layers_per_stage"] == [1, 3] and len(shown["stage_times"]) == 2
