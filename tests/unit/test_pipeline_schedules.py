"""Pipeline schedules as data: completeness, deadlock freedom, memory and bubble.

Every generated schedule is run through the symbolic simulator for a range of layouts;
the properties are checked against the action lists themselves, against hand-derived
lists for small cases, and against the closed-form bubble of the papers.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from plugintrain.strategies.pipeline_schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Schedule,
    Simulation,
    Transfer,
    build_schedule,
    check_complete,
    check_rendezvous,
    forward_only,
    gpipe,
    interleaved,
    one_f_one_b,
    p2p_plan,
    release_points,
    simulate,
    textbook_bubble,
    validate,
)
from plugintrain.tools.schedule import to_json

PPS = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 4, 8, 16)
TIMES = ((1, 2), (1, 1))
"""``(forward_time, backward_time)``: the usual 1:2 ratio, and equal times."""

FLAT = [(name, pp, 1, m) for name in ("gpipe", "1f1b") for pp in PPS for m in MICROBATCHES]
INTERLEAVED = [
    ("interleaved", pp, vpp, pp * groups)
    for pp in PPS
    for vpp in (2, 3)
    for groups in (1, 2, 4)  # the interleaved schedule needs microbatches % pp == 0
]
LAYOUTS = FLAT + INTERLEAVED


def _ids(layouts: list[tuple]) -> list[str]:
    return [f"{name}-pp{pp}-vpp{vpp}-m{m}" for name, pp, vpp, m in layouts]


layouts = pytest.mark.parametrize(("name", "pp", "vpp", "m"), LAYOUTS, ids=_ids(LAYOUTS))
times = pytest.mark.parametrize(("forward_time", "backward_time"), TIMES, ids=["f1b2", "f1b1"])


def _text(actions: list[Action]) -> str:
    return " ".join(str(action) for action in actions)


def _running_in_flight(actions: list[Action]) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        assert live >= 0, f"a backward before its forward in {_text(actions)}"
        peak = max(peak, live)
    return peak


# ---- structure of the generated action lists ------------------------------------------------


@layouts
@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward_only"])
def test_every_forward_and_backward_runs_exactly_once(
    name: str, pp: int, vpp: int, m: int, forward_only: bool
) -> None:
    schedule = build_schedule(name, pp, vpp, m, forward_only)
    assert (schedule.name, schedule.pp, schedule.vpp, schedule.microbatches) == (name, pp, vpp, m)
    assert schedule.forward_only is forward_only
    assert len(schedule.actions) == pp
    kinds = ("F",) if forward_only else ("F", "B")
    expected = Counter(Action(k, mb, c) for k in kinds for mb in range(m) for c in range(vpp))
    for rank, actions in enumerate(schedule.actions):
        assert Counter(actions) == expected, f"rank {rank}: {_text(actions)}"
    check_complete(schedule)  # agrees: no exception


@pytest.mark.parametrize(("pp", "m"), [(pp, m) for pp in PPS for m in MICROBATCHES])
def test_one_f_one_b_shape(pp: int, m: int) -> None:
    """Warm-up forwards, then never two forwards in a row; both kinds in micro-batch order."""
    for rank, actions in enumerate(one_f_one_b(pp, m).actions):
        warmup = min(pp - rank - 1, m)
        assert all(a.kind == "F" for a in actions[:warmup])
        first_backward = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert first_backward == min(warmup + 1, m)
        after = "".join(a.kind for a in actions[first_backward:])
        assert "FF" not in after, f"rank {rank}: {_text(actions)}"
        for kind in "FB":
            assert [a.microbatch for a in actions if a.kind == kind] == list(range(m))


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), INTERLEAVED, ids=_ids(INTERLEAVED))
def test_interleaved_visits_chunks_in_groups_of_pp(name: str, pp: int, vpp: int, m: int) -> None:
    """Forwards go chunk 0..vpp-1 for each group of pp micro-batches, backwards chunk vpp-1..0."""
    forward_order = sorted(
        (Action("F", mb, c) for mb in range(m) for c in range(vpp)),
        key=lambda a: (a.microbatch // pp, a.chunk, a.microbatch % pp),
    )
    backward_order = sorted(
        (Action("B", mb, c) for mb in range(m) for c in range(vpp)),
        key=lambda a: (a.microbatch // pp, -a.chunk, a.microbatch % pp),
    )
    for actions in interleaved(pp, vpp, m).actions:
        assert [a for a in actions if a.kind == "F"] == forward_order
        assert [a for a in actions if a.kind == "B"] == backward_order


# ---- hand-derived lists for small cases ---------------------------------------------------------


def test_one_f_one_b_pp4_m4_by_hand() -> None:
    # rank r: pp - r - 1 warm-up forwards, then F/B alternating, then the remaining B.
    assert [_text(a) for a in one_f_one_b(4, 4).actions] == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_one_f_one_b_pp4_m8_by_hand() -> None:
    actions = one_f_one_b(4, 8).actions
    assert _text(actions[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _text(actions[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_gpipe_pp2_m3_by_hand() -> None:
    assert [_text(a) for a in gpipe(2, 3).actions] == ["F0 F1 F2 B0 B1 B2"] * 2


def test_interleaved_pp2_vpp2_m4_by_hand() -> None:
    # Megatron's order: forward k is micro-batch (k // 4) * 2 + k % 2 of chunk (k % 4) // 2,
    #   F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1; backwards mirror the chunks: B0.1 B1.1 B0 B1 B2.1 ...
    # Warm-up: (pp - r - 1) * 2 + (vpp - 1) * pp forwards = 4 on rank 0 and 2 on rank 1;
    # then one forward and one backward at a time; then the remaining backwards.
    rank0, rank1 = interleaved(2, 2, 4).actions
    assert _text(rank0) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert _text(rank1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"


def test_interleaved_with_one_group_is_all_forwards_then_all_backwards() -> None:
    # microbatches == pp: Megatron warms up with every forward.
    for actions in interleaved(3, 2, 3).actions:
        assert _text(actions) == "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 B1.1 B2.1 B0 B1 B2"


# ---- simulation: deadlock freedom, causality, memory, bubble -----------------------------------


def _check_causal(sim: Simulation) -> None:
    """Each action starts after its inputs exist and after its rank's previous action."""
    s = sim.schedule
    end = {(slot.action.kind, slot.stage, slot.action.microbatch): slot.end
           for rank in sim.timeline for slot in rank}  # fmt: skip
    last = s.num_stages - 1
    for rank, slots in enumerate(sim.timeline):
        assert [slot.action for slot in slots] == s.actions[rank]
        for previous, slot in zip([None, *slots], slots, strict=False):
            assert slot.start >= (previous.end if previous else 0)
            assert slot.stage == s.stage_of(rank, slot.action.chunk)
            mb = slot.action.microbatch
            duration = sim.forward_time if slot.action.kind == "F" else sim.backward_time
            assert slot.end - slot.start == duration / s.vpp
            if slot.action.kind == "F" and slot.stage > 0:
                assert slot.start >= end[("F", slot.stage - 1, mb)]
            if slot.action.kind == "B":
                assert slot.start >= end[("F", slot.stage, mb)]
                if slot.stage < last:
                    assert slot.start >= end[("B", slot.stage + 1, mb)]


@layouts
@times
def test_simulates_without_deadlock_and_in_p2p_order(
    name: str, pp: int, vpp: int, m: int, forward_time: int, backward_time: int
) -> None:
    sim = simulate(build_schedule(name, pp, vpp, m), forward_time, backward_time)
    _check_causal(sim)
    assert sim.p2p_in_order is True
    assert sim.makespan == max(rank[-1].end for rank in sim.timeline)
    assert sim.busy == [m * Fraction(forward_time + backward_time)] * pp
    assert sim.idle == [1 - busy / sim.makespan for busy in sim.busy]


@layouts
def test_peak_in_flight(name: str, pp: int, vpp: int, m: int) -> None:
    schedule = build_schedule(name, pp, vpp, m)
    sim = simulate(schedule)
    assert sim.peak_in_flight == [_running_in_flight(actions) for actions in schedule.actions]
    for rank, peak in enumerate(sim.peak_in_flight):
        if name == "gpipe":
            assert peak == m
        elif name == "1f1b":
            assert peak == min(pp - rank, m)
        elif m == pp:
            assert peak == m * vpp  # one group: every forward before the first backward
        else:
            assert peak == (pp - rank - 1) * 2 + (vpp - 1) * pp + 1
    assert sim.peak_in_flight == sorted(sim.peak_in_flight, reverse=True)


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), FLAT, ids=_ids(FLAT))
@times
def test_flat_schedules_have_the_textbook_bubble(
    name: str, pp: int, vpp: int, m: int, forward_time: int, backward_time: int
) -> None:
    sim = simulate(build_schedule(name, pp, vpp, m), forward_time, backward_time)
    assert sim.bubble_fraction == Fraction(pp - 1, m + pp - 1) == textbook_bubble(pp, m)
    assert sim.makespan == (m + pp - 1) * (forward_time + backward_time)
    assert sim.idle == [sim.bubble_fraction] * pp


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), INTERLEAVED, ids=_ids(INTERLEAVED))
@times
def test_interleaved_shrinks_the_bubble_vpp_fold(
    name: str, pp: int, vpp: int, m: int, forward_time: int, backward_time: int
) -> None:
    sim = simulate(interleaved(pp, vpp, m), forward_time, backward_time)
    assert sim.bubble_fraction == Fraction(pp - 1, vpp * m + pp - 1) == textbook_bubble(pp, m, vpp)
    flat = simulate(one_f_one_b(pp, m), forward_time, backward_time)
    if pp > 1:
        assert sim.bubble_fraction < flat.bubble_fraction
        assert sim.makespan < flat.makespan
    else:
        assert sim.bubble_fraction == flat.bubble_fraction == 0


@layouts
def test_forward_only_runs_forwards_alone(name: str, pp: int, vpp: int, m: int) -> None:
    schedule = build_schedule(name, pp, vpp, m, forward_only=True)
    assert schedule.name == name
    assert {a.kind for actions in schedule.actions for a in actions} == {"F"}
    assert schedule.forward_only is True
    sim = simulate(schedule, 1, 2)
    _check_causal(sim)
    assert sim.p2p_in_order is True
    assert sim.makespan == Fraction(vpp * m + pp - 1, vpp)
    assert sim.bubble_fraction == textbook_bubble(pp, m, vpp)


@pytest.mark.parametrize(
    ("pp", "vpp", "m"), [(1, 1, 1), (2, 1, 3), (4, 2, 3), (3, 3, 7), (4, 2, 8), (8, 1, 5)]
)
def test_evaluation_schedule_takes_any_microbatch_count(pp: int, vpp: int, m: int) -> None:
    schedule = forward_only(pp, vpp, m)
    expected = [Action("F", mb, c) for c in range(vpp) for mb in range(m)]
    assert schedule.actions == [expected] * pp
    assert schedule.forward_only is True
    sim = simulate(schedule, 1, 2)
    _check_causal(sim)
    assert sim.p2p_in_order is True
    if m >= pp or vpp == 1:
        assert sim.bubble_fraction == textbook_bubble(pp, m, vpp)
    else:  # chunk 1 of rank 0 waits for micro-batch 0 to leave the last rank's chunk 0
        assert sim.bubble_fraction > textbook_bubble(pp, m, vpp)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        forward_only(pp, vpp, 0)


# ---- hand-made schedules that must be refused ---------------------------------------------------


def _schedule(pp: int, m: int, *ranks: str, vpp: int = 1, name: str = "custom") -> Schedule:
    def parse(token: str) -> Action:
        head, _, chunk = token.partition(".")
        return Action(head[0], int(head[1:]), int(chunk or 0))  # type: ignore[arg-type]

    return Schedule(name, pp, vpp, m, [[parse(t) for t in rank.split()] for rank in ranks])


@pytest.mark.parametrize(
    ("ranks", "stuck"),
    [
        # rank 1's F1 needs rank 0's F1, queued behind B0, which needs rank 1's B0.
        (("F0 B0 F1 B1", "F1 B1 F0 B0"), ["rank 0 waits at B0", "rank 1 waits at F1"]),
        # one rank cannot run a backward before its own forward.
        (("B0 F0",), ["rank 0 waits at B0"]),
        # rank 0 waits for B0 before sending F1; rank 1 runs F1 before B0.
        (("F0 B0 F1 B1", "F0 F1 B0 B1"), ["rank 0 waits at B0", "rank 1 waits at F1"]),
    ],
    ids=["crossed", "backward_first", "late_backward"],
)
def test_deadlock_names_the_stuck_actions(ranks: tuple[str, ...], stuck: list[str]) -> None:
    schedule = _schedule(len(ranks), 2 if len(ranks) > 1 else 1, *ranks)
    check_complete(schedule)  # complete: the problem is the order
    with pytest.raises(DeadlockError, match="custom schedule deadlocks") as raised:
        simulate(schedule)
    for phrase in stuck:
        assert phrase in str(raised.value)


def test_reordered_receives_run_but_are_out_of_p2p_order() -> None:
    # Rank 1 takes micro-batch 1 before 0: no cycle, but on NCCL (which ignores tags) its
    # first receive would match rank 0's first send, the activation of micro-batch 0.
    schedule = _schedule(2, 2, "F0 F1 B0 B1", "F1 F0 B1 B0")
    sim = simulate(schedule)
    assert sim.p2p_in_order is False
    _check_causal(sim)


def test_deadlock_across_chunks() -> None:
    # pp=2, vpp=2: rank 0 runs chunk 1 (stage 2) before rank 1 has run stage 1.
    schedule = _schedule(2, 1, "F0.1 F0 B0.1 B0", "F0 F0.1 B0.1 B0", vpp=2)
    with pytest.raises(DeadlockError, match=r"rank 0 waits at F0\.1, rank 1 waits at F0\b"):
        simulate(schedule)


@pytest.mark.parametrize(
    ("ranks", "match"),
    [
        (("F0 F1 B0", "F0 B0 F1 B1"), r"rank 0 of the custom schedule: missing \[\('B', 1, 0\)\]"),
        (("F0 F1 B0 B1", "F0 B0 F1 B1 B1"), r"rank 1 .*repeated \[\('B', 1, 0\)\]"),
        (("F0 F1 B0 B1 F2", "F0 B0 F1 B1"), r"rank 0 .*unexpected \[\('F', 2, 0\)\]"),
        (("F0 F1 B0 B1",), r"1 action lists for pp=2"),
    ],
    ids=["missing", "repeated", "extra", "missing_rank"],
)
def test_incomplete_schedule_is_refused(ranks: tuple[str, ...], match: str) -> None:
    schedule = _schedule(2, 2, *ranks)
    with pytest.raises(ValueError, match=match):
        check_complete(schedule)
    with pytest.raises(ValueError, match=match):
        simulate(schedule)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "pp", "vpp", "m", "match"),
    [
        ("zero_bubble", 2, 1, 4, r"Unknown pipeline schedule 'zero_bubble'; use one of \["),
        ("gpipe", 2, 2, 4, r"schedule='gpipe' .* virtual_pipeline_parallel=2; use schedule="),
        ("1f1b", 2, 3, 4, r"schedule='1f1b' .* virtual_pipeline_parallel=3"),
        ("interleaved", 4, 2, 6, r"got microbatches=6; use e\.g\. 8\."),
        (
            "interleaved",
            4,
            2,
            2,
            r"multiple of pipeline_parallel=4 .* microbatches=2; use e\.g\. 4",
        ),
        ("1f1b", 0, 1, 4, r"pipeline_parallel must be an integer >= 1, got 0\."),
        ("interleaved", 2, 0, 4, r"virtual_pipeline_parallel must be an integer >= 1, got 0\."),
        ("gpipe", 2, 1, -1, r"microbatches must be an integer >= 1, got -1\."),
        ("gpipe", 2.0, 1, 4, r"pipeline_parallel must be an integer >= 1, got 2\.0\."),
        ("gpipe", True, 1, 4, r"pipeline_parallel must be an integer >= 1, got True\."),
    ],
)
def test_validate_names_the_value_and_the_fix(
    name: str, pp: int, vpp: int, m: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        validate(pp, vpp, m, name)
    with pytest.raises(ValueError, match=match):
        build_schedule(name, pp, vpp, m)


def test_generators_validate_their_arguments() -> None:
    with pytest.raises(ValueError, match="got 0"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="got microbatches=6"):
        interleaved(4, 2, 6)


def test_schedule_names_and_stage_layout() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved")
    schedule = interleaved(4, 2, 4)
    assert schedule.num_stages == 8
    assert [schedule.stage_of(rank, 1) for rank in range(4)] == [4, 5, 6, 7]
    assert [schedule.rank_of(stage) for stage in (0, 3, 4, 7)] == [(0, 0), (3, 0), (0, 1), (3, 1)]


# ---- text output --------------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return line.split("|", 1)[1].split()


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_grid_one_row_per_rank_idle_while_filling(pp: int, m: int) -> None:
    sim = simulate(one_f_one_b(pp, m), 1, 2)  # one column per time unit
    lines = sim.grid().splitlines()
    assert len(lines) == pp + 1
    assert lines[0].split()[:3] == ["time", "|", "0"]
    for rank, line in enumerate(lines[1:]):
        assert line.startswith(f"rank {rank:>2} | ")
        cells = _cells(line)
        assert cells[:rank] == ["."] * rank  # waits for the first forward to arrive
        assert cells[rank] == "F0"
        assert "B0" in cells
        assert len(cells) == sim.makespan
        assert cells.count(".") == sim.makespan - sim.busy[rank]


def test_grid_axis_is_in_time_units() -> None:
    sim = simulate(interleaved(2, 2, 4), 1, 2)  # half-unit columns, makespan 13.5
    lines = sim.grid().splitlines()
    assert sim.makespan == Fraction(27, 2)
    assert lines[0].split() == ["time", "|", "0", "5", "10"]
    assert all(len(_cells(line)) == 27 for line in lines[1:])
    assert _cells(lines[1])[:3] == ["F0", "F1", "F0.1"]
    assert _cells(lines[2])[:5] == [".", "F0", "F1", "F0.1", "B0.1"]
    # Cells are 4 characters ("F0.1") and a space after a 10-character prefix: the header's
    # "10" sits above column 20, which starts at time 10.
    assert lines[0][10 + 20 * 5 :] == "10"  # the last label; the header is right-stripped
    assert sim.timeline[0][-1].end == Fraction(27, 2)
    assert lines[1][10 + 26 * 5 :] == "B3"  # rank 0's last cell: the last half unit


def test_summary_reports_bubble_idle_and_peak() -> None:
    sim = simulate(one_f_one_b(4, 8), 1, 2)
    lines = sim.summary().splitlines()
    assert len(lines) == 4 + 2
    assert lines[0].startswith("schedule=1f1b pp=4 vpp=1 microbatches=8")
    assert "peak in-flight 4 micro-batch chunks" in lines[1]
    assert "peak in-flight 1 micro-batch chunks" in lines[4]
    assert "idle  27.3%" in lines[2]
    assert lines[-1].startswith("makespan 33, bubble 27.3%")
    assert "p2p order matched: True" in lines[-1]
    interleaved_summary = simulate(interleaved(4, 2, 8)).summary()
    assert "makespan 28.5, bubble 15.8%" in interleaved_summary


# ---- releasing sent tensors -------------------------------------------------------------------


def test_release_points_one_f_one_b_pp2_m4_by_hand() -> None:
    schedule = build_schedule("1f1b", 2, 1, 4)
    # Rank 0 (F0 F1 B0 F2 B1 F3 B2 B3): its activation for micro-batch i is delivered once
    # the gradient of i came back, at B_i.
    assert release_points(schedule, 0) == {
        2: [("F", 0, 0)],
        4: [("F", 0, 1)],
        6: [("F", 0, 2)],
        7: [("F", 0, 3)],
    }
    # Rank 1 (F0 B0 F1 B1 F2 B2 F3 B3): its gradient of i is delivered once rank 0 sent an
    # activation after its B_i: F2 answers B0, F3 answers B1; the last two wait for the
    # end of the step.
    assert release_points(schedule, 1) == {4: [("B", 1, 0)], 6: [("B", 1, 1)]}


@layouts
@pytest.mark.parametrize("forward_only_", [False, True], ids=["train", "forward_only"])
def test_a_send_is_released_only_after_its_receiver_ran(
    name: str, pp: int, vpp: int, m: int, forward_only_: bool
) -> None:
    """Checked on the simulated timeline: the action after which a send is released
    starts no earlier than the end of the receiver's action that consumed the message
    (its answer is sent at the end of that action or later)."""
    schedule = forward_only(pp, vpp, m) if forward_only_ else build_schedule(name, pp, vpp, m)
    sim = simulate(schedule)
    end = {
        (slot.action.kind, slot.stage, slot.action.microbatch): slot.end
        for rank in sim.timeline
        for slot in rank
    }
    for rank in range(pp):
        for index, messages in release_points(schedule, rank).items():
            releaser = sim.timeline[rank][index]
            for kind, stage, mb in messages:
                consumer = ("F", stage + 1, mb) if kind == "F" else ("B", stage - 1, mb)
                assert releaser.start >= end[consumer], (rank, index, (kind, stage, mb))


# ---- NCCL-safe batches: each send waits for its receive ----------------------------------------


def _accepts(name: str, pp: int, vpp: int, m: int) -> bool:
    try:
        validate(pp, vpp, m, name)  # what PipelineOptions.resolve lets a strategy run
    except ValueError:
        return False
    return True


# Every layout the strategies accept for pp 2..8, vpp 1..4 and up to 32 micro-batches.
GRID = [(pp, vpp, m) for pp in range(2, 9) for vpp in range(1, 5) for m in range(1, 33)]
ACCEPTED = {name: [layout for layout in GRID if _accepts(name, *layout)] for name in SCHEDULES}


def _io(s: Schedule, rank: int, action: Action) -> tuple[tuple | None, tuple | None]:
    """The message ``action`` receives and the one it sends, from the stage layout."""
    stage, mb, last = s.stage_of(rank, action.chunk), action.microbatch, s.num_stages - 1
    if action.kind == "F":
        return ("F", stage - 1, mb) if stage else None, ("F", stage, mb) if stage < last else None
    return ("B", stage + 1, mb) if stage < last else None, ("B", stage, mb) if stage else None


def _check_plan(s: Schedule, plan: list[list[tuple[Transfer, ...]]]) -> int:
    """What the executor relies on, read off the batches; returns the most actions that
    come between a receive and the action that needs it."""
    early = 0
    links: dict[tuple[str, int, int], list[tuple]] = defaultdict(list)
    for rank, batches in enumerate(plan):
        io = [_io(s, rank, action) for action in s.actions[rank]]
        assert len(batches) == len(io) + 1
        posted: dict[tuple, int] = {}
        for index, batch in enumerate(batches):
            produced = io[index - 1][1] if index else None
            # what an action produces goes out at once: no send is held back
            assert [t.message for t in batch if t.op == "send"] == ([produced] if produced else [])
            for op, message, peer in batch:
                kind, stage, _ = message
                other = stage + (1 if kind == "F" else -1) if op == "send" else stage
                assert peer == other % s.pp != rank
                links[(op, rank, peer) if op == "send" else (op, peer, rank)].append(message)
                if op == "recv":
                    posted[message] = index
        for index, (needed, _) in enumerate(io):
            if needed is not None:
                at = posted.pop(needed)
                assert at <= index, (rank, s.actions[rank][index])  # received before it runs
                early = max(early, index - at)
        assert not posted, f"rank {rank} receives what it never uses: {posted}"
    # NCCL ignores tags: on every link, the receives come in the order of the sends.
    sends = {link[1:]: messages for link, messages in links.items() if link[0] == "send"}
    receives = {link[1:]: messages for link, messages in links.items() if link[0] == "recv"}
    assert sends == receives
    return early


def test_accepted_layouts_are_enumerated() -> None:
    # GPipe and 1F1B run one chunk: 7 pp x 32 m = 224 layouts each; interleaved needs
    # microbatches % pp == 0: 4 vpp x (16 + 10 + 8 + 6 + 5 + 4 + 4) = 212.
    counts = {name: len(layouts) for name, layouts in ACCEPTED.items()}
    assert counts == {"gpipe": 224, "1f1b": 224, "interleaved": 212}
    assert (4, 2, 6) not in ACCEPTED["interleaved"] and (4, 2, 8) in ACCEPTED["interleaved"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_batches_complete_when_each_send_waits_for_its_receive(name: str) -> None:
    """The proof, over every accepted layout, for the batches the executor posts."""
    most_early = 0
    for pp, vpp, m in ACCEPTED[name]:
        schedule = build_schedule(name, pp, vpp, m)
        plan = p2p_plan(schedule)
        check_rendezvous(schedule, plan)
        most_early = max(most_early, _check_plan(schedule, plan))
    # GPipe and 1F1B receive just in time; interleaved at most one action early (a rank
    # holds one received buffer more, at most).
    assert most_early == (1 if name == "interleaved" else 0)


def test_evaluation_batches_complete_when_each_send_waits_for_its_receive() -> None:
    """Evaluation runs `forward_only` for any micro-batch count (the gcd of the batch and
    `microbatches`): every layout of the grid."""
    for pp, vpp, m in GRID:
        schedule = forward_only(pp, vpp, m)
        plan = p2p_plan(schedule)
        check_rendezvous(schedule, plan)
        early = _check_plan(schedule, plan)
        assert early == 0 or vpp > 1  # one chunk: a chain, received just in time


def _brief(plan: list[list[tuple[Transfer, ...]]]) -> list[list[str]]:
    return [
        [", ".join(f"{t.op} {t.message[0]}{t.message[2]}" for t in batch) for batch in batches]
        for batches in plan
    ]


def test_one_f_one_b_sends_with_the_receive_needed_next_by_hand() -> None:
    # Entry i goes out before action i; rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 and rank 1
    # F0 B0 F1 B1 F2 B2 F3 B3. In the steady state rank 0 posts "send F_i, recv B_j" while
    # rank 1 posts "send B_j, recv F_i" (Megatron's send_forward_recv_backward and
    # send_backward_recv_forward), so neither waits for the other.
    rank0, rank1 = _brief(p2p_plan(one_f_one_b(2, 4)))
    assert rank0 == ["", "send F0", "send F1, recv B0", "", "send F2, recv B1", "",
                     "send F3, recv B2", "recv B3", ""]  # fmt: skip
    assert rank1 == ["recv F0", "", "send B0, recv F1", "", "send B1, recv F2", "",
                     "send B2, recv F3", "", "send B3"]  # fmt: skip


def _one_at_a_time(plan: list[list[tuple[Transfer, ...]]]) -> list[list[tuple[Transfer, ...]]]:
    """The same transfers posted one by one, each send before the receive beside it: the
    executor before batching (isend, then irecv and wait)."""
    return [[(t,) for batch in batches for t in batch] for batches in plan]


def test_unpaired_one_f_one_b_hangs_when_sends_wait_for_receives() -> None:
    schedule = one_f_one_b(2, 4)
    simulate(schedule)  # runs where sends never wait (gloo)
    # Both ranks send first: rank 0 F1 (received after rank 1's send of B0), rank 1 B0
    # (received after rank 0's send of F1). NVIDIA/nccl#479.
    with pytest.raises(DeadlockError) as raised:
        check_rendezvous(schedule, _one_at_a_time(p2p_plan(schedule)))
    assert str(raised.value) == (
        "The 1f1b schedule deadlocks when a send waits for its receive: rank 0 waits at"
        " [send F1 of stage 0 to rank 1], rank 1 waits at [send B0 of stage 1 to rank 0]."
    )


@pytest.mark.parametrize("name", SCHEDULES)
def test_unpaired_batches_hang_wherever_neighbours_exchange(name: str) -> None:
    """Posted one transfer at a time, every layout hangs whose ranks send both ways in
    turn: all of 1F1B's and interleaved's but those that run like GPipe (one
    micro-batch, or interleaved with vpp = 1 and m = pp: every forward first)."""
    for pp, vpp, m in ACCEPTED[name][::5]:
        schedule = build_schedule(name, pp, vpp, m)
        unpaired = _one_at_a_time(p2p_plan(schedule))
        if name == "gpipe" or m == 1 or (name == "interleaved" and vpp == 1 and m == pp):
            check_rendezvous(schedule, unpaired)
        else:
            with pytest.raises(DeadlockError, match="deadlocks when a send waits"):
                check_rendezvous(schedule, unpaired)


def _just_in_time(
    s: Schedule, plan: list[list[tuple[Transfer, ...]]]
) -> list[list[tuple[Transfer, ...]]]:
    """The same transfers with every receive moved back to just before its action."""
    moved = []
    for rank, batches in enumerate(plan):
        receives = {t.message: t for batch in batches for t in batch if t.op == "recv"}
        rank_batches = [[t for t in batch if t.op == "send"] for batch in batches]
        for index, action in enumerate(s.actions[rank]):
            needed = _io(s, rank, action)[0]
            if needed is not None:
                rank_batches[index].append(receives[needed])
        moved.append([tuple(batch) for batch in rank_batches])
    return moved


def test_interleaved_posts_a_receive_early_where_just_in_time_hangs() -> None:
    # pp = 2, vpp = 2: after B0.1, rank 0 sends B0 of stage 2 alone (its next action, F3
    # on stage 0, receives nothing) and receives B1 of stage 3 only in the batch after;
    # rank 1 sends that B1 before it receives rank 0's B0 in its next batch. Both sends
    # wait, so rank 1 receives B0 with the input of F2, an action before B0 needs it.
    schedule = interleaved(2, 2, 4)
    plan = p2p_plan(schedule)
    check_rendezvous(schedule, plan)
    with pytest.raises(DeadlockError, match=r"rank 0 waits at \[send B0 of stage 2 to rank 1\]"):
        check_rendezvous(schedule, _just_in_time(schedule, plan))
    assert _text(schedule.actions[1][6:8]) == "F2 B0"
    assert _brief(plan)[1][6:8] == ["send B1, recv F2, recv B0", "send F2, recv F3"]


def test_simulate_in_rendezvous_mode() -> None:
    sim = simulate(interleaved(4, 2, 8), rendezvous=True)
    assert sim.rendezvous is True
    assert to_json(sim)["rendezvous_deadlock_free"] is True  # `plugintrain schedule --json`
    assert sim.summary().endswith(
        "p2p order matched: True, deadlock-free when sends wait for their receives (NCCL)"
    )
    assert simulate(interleaved(4, 2, 8)).rendezvous is False
    assert "sends wait" not in simulate(interleaved(4, 2, 8)).summary()
    # A send that no rank receives waits forever.
    hand_made = [[(Transfer("send", ("F", 0, 0), 1),)], [()]]
    with pytest.raises(DeadlockError, match=r"rank 0 waits at \[send F0 of stage 0 to rank 1\]"):
        check_rendezvous(one_f_one_b(2, 1), hand_made)
