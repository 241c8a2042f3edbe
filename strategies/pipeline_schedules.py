"""Pipeline schedules as data, and a simulator that runs them symbolically.

A schedule is one ordered list of :class:`Action` per pipeline rank: forward or backward
of one micro-batch through one of the rank's model chunks. Communication is implied by
the actions, as the executor (:mod:`plugintrain.strategies.pipeline`) performs it: the
forward of virtual stage ``s > 0`` receives its input from stage ``s - 1``, a forward
that is not the last stage sends its output on, and backward runs the other way.
Sends are asynchronous and receives block, so a schedule can only hang on a cycle of
data dependencies, which :func:`simulate` detects.

Virtual stages follow Megatron-LM's interleaving: with ``pp`` ranks and ``vpp`` chunks per
rank, chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``, so the model's layers
wind ``vpp`` times around the ranks.

The generators are the textbook ones:

- :func:`gpipe`: all forwards, then all backwards (Huang et al., 2019).
- :func:`one_f_one_b`: ``pp - rank - 1`` warm-up forwards, then alternating one forward and
  one backward, then the remaining backwards (PipeDream-Flush; Narayanan et al., 2021).
- :func:`interleaved`: Megatron-LM's interleaved 1F1B over ``vpp`` chunks per rank
  (``megatron/core/pipeline_parallel/schedules.py``), which shrinks the bubble ``vpp``-fold.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank."""

    kind: Literal["F", "B"]
    """``"F"`` forward, ``"B"`` backward."""
    microbatch: int
    """Micro-batch index, ``0 .. microbatches - 1``."""
    chunk: int = 0
    """Index of the model chunk on this rank, ``0 .. vpp - 1``."""

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Schedule:
    """Per-rank action lists of one training (or forward-only) step."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    actions: list[list[Action]]
    """``actions[rank]``: that rank's actions in execution order."""
    forward_only: bool = False

    @property
    def num_stages(self) -> int:
        """Virtual stages: ``pp * vpp``."""
        return self.pp * self.vpp

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that ``chunk`` of ``rank`` runs."""
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that runs virtual ``stage``."""
        return stage % self.pp, stage // self.pp


def _check_degrees(pp: int, vpp: int, microbatches: int) -> None:
    for label, value in (
        ("pipeline_parallel", pp),
        ("virtual_pipeline_parallel", vpp),
        ("microbatches", microbatches),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}.")


def validate(pp: int, vpp: int, microbatches: int, name: str) -> None:
    """Raise a ``ValueError`` naming the fix if ``name`` cannot schedule this layout.

    Args:
        pp: Pipeline ranks.
        vpp: Model chunks per rank.
        microbatches: Micro-batches per step.
        name: One of :data:`SCHEDULES`.
    """
    if name not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {name!r}; use one of {list(SCHEDULES)}.")
    _check_degrees(pp, vpp, microbatches)
    if name != "interleaved" and vpp != 1:
        raise ValueError(
            f"schedule={name!r} runs one model chunk per rank, but virtual_pipeline_parallel="
            f"{vpp}; use schedule='interleaved' or virtual_pipeline_parallel=1."
        )
    if name == "interleaved" and microbatches % pp:
        raise ValueError(
            f"The interleaved schedule needs microbatches to be a multiple of"
            f" pipeline_parallel={pp} (micro-batches advance in groups of pp through each"
            f" chunk), got microbatches={microbatches}; use e.g. {pp * -(-microbatches // pp)}."
        )


def gpipe(pp: int, microbatches: int, forward_only: bool = False) -> Schedule:
    """All forwards, then all backwards in the same micro-batch order (GPipe)."""
    validate(pp, 1, microbatches, "gpipe")
    forwards = [Action("F", m) for m in range(microbatches)]
    backwards = [] if forward_only else [Action("B", m) for m in range(microbatches)]
    return Schedule(
        "gpipe", pp, 1, microbatches, [forwards + backwards for _ in range(pp)], forward_only
    )


def one_f_one_b(pp: int, microbatches: int, forward_only: bool = False) -> Schedule:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Rank ``r`` runs ``min(pp - r - 1, microbatches)`` warm-up forwards, so it never holds
    the activations of more than ``pp - r`` micro-batches at once.
    """
    validate(pp, 1, microbatches, "1f1b")
    if forward_only:
        return Schedule("1f1b", pp, 1, microbatches, gpipe(pp, microbatches, True).actions, True)
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        steps = [Action("F", m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            steps += [Action("F", warmup + i), Action("B", i)]
        steps += [Action("B", m) for m in range(microbatches - warmup, microbatches)]
        actions.append(steps)
    return Schedule("1f1b", pp, 1, microbatches, actions)


def interleaved(pp: int, vpp: int, microbatches: int, forward_only: bool = False) -> Schedule:
    """Megatron-LM's interleaved 1F1B with ``vpp`` model chunks per rank.

    Forwards visit the chunks in groups of ``pp`` micro-batches (chunk 0 for micro-batches
    ``0..pp-1``, chunk 1 for the same, ..., then the next group); backwards visit the chunks
    in reverse. Rank ``r`` warms up with ``(pp - r - 1) * 2 + (vpp - 1) * pp`` forwards
    (all of them when ``microbatches == pp``).
    """
    validate(pp, vpp, microbatches, "interleaved")
    total = microbatches * vpp
    group = pp * vpp

    def forward(k: int) -> Action:
        return Action("F", (k // group) * pp + k % pp, (k % group) // pp)

    def backward(k: int) -> Action:
        return Action("B", (k // group) * pp + k % pp, vpp - 1 - (k % group) // pp)

    actions = []
    for rank in range(pp):
        if forward_only or microbatches == pp:
            warmup = total
        else:
            warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
        steps = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            steps += [forward(warmup + k), backward(k)]
        if not forward_only:
            steps += [backward(k) for k in range(total - warmup, total)]
        actions.append(steps)
    return Schedule("interleaved", pp, vpp, microbatches, actions, forward_only)


def forward_only(pp: int, vpp: int, microbatches: int) -> Schedule:
    """Evaluation: every micro-batch forward through chunk 0, then chunk 1, ... on every rank.

    Ordering by (chunk, micro-batch) follows the stage order, so it cannot deadlock for any
    number of micro-batches (unlike training schedules, it has no divisibility needs).
    """
    _check_degrees(pp, vpp, microbatches)
    steps = [Action("F", m, c) for c in range(vpp) for m in range(microbatches)]
    return Schedule("forward", pp, vpp, microbatches, [list(steps) for _ in range(pp)], True)


def build_schedule(
    name: str, pp: int, vpp: int, microbatches: int, forward_only: bool = False
) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`) for this layout."""
    validate(pp, vpp, microbatches, name)
    if name == "gpipe":
        return gpipe(pp, microbatches, forward_only)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches, forward_only)
    return interleaved(pp, vpp, microbatches, forward_only)


# ---- simulation ---------------------------------------------------------------------------


class DeadlockError(RuntimeError):
    """The schedule's ranks wait on each other in a cycle (or on work nobody does)."""


@dataclass
class TimeSlot:
    """An action placed in time on one rank."""

    action: Action
    stage: int
    start: Fraction
    end: Fraction


@dataclass
class Simulation:
    """What :func:`simulate` found."""

    schedule: Schedule
    timeline: list[list[TimeSlot]]
    """Per rank, the actions with their start and end times."""
    makespan: Fraction
    """Time from the first action to the last."""
    busy: list[Fraction]
    """Per rank, the time spent computing."""
    peak_in_flight: list[int]
    """Per rank, most micro-batch chunks whose forward ran and backward did not yet."""
    p2p_in_order: bool
    """Whether, on every link and direction, messages are received in the order sent
    (so the executor's isend/irecv also match on backends that ignore tags, like NCCL)."""
    forward_time: Fraction = Fraction(1)
    backward_time: Fraction = Fraction(2)
    idle: list[Fraction] = field(init=False)
    """Per rank, the fraction of the makespan spent idle."""

    def __post_init__(self) -> None:
        self.idle = [1 - b / self.makespan for b in self.busy]

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle fraction of the whole pipeline: ``1 - sum(busy) / (pp * makespan)``."""
        return 1 - sum(self.busy) / (self.schedule.pp * self.makespan)

    def grid(self) -> str:
        """A time-by-rank grid: one column per time unit, ``.`` where a rank is idle.

        Cells read ``F3`` (forward of micro-batch 3) or ``B3.1`` (backward, chunk 1).
        """
        unit = _gcd_time(self.timeline)
        columns = int(self.makespan / unit)
        labels = [[str(slot.action) for slot in rank] for rank in self.timeline]
        width = max([len(label) for rank in labels for label in rank] + [1])
        lines = []
        times = (col * unit for col in range(columns))  # label the time, not the column
        axis = "".join(f"{t!s:<{width + 1}}" if t % 5 == 0 else " " * (width + 1) for t in times)
        lines.append(f"{'time':>7} | {axis.rstrip()}")
        for rank, slots in enumerate(self.timeline):
            cells = ["." for _ in range(columns)]
            for slot in slots:
                for col in range(int(slot.start / unit), int(slot.end / unit)):
                    cells[col] = str(slot.action)
            row = " ".join(f"{c:<{width}}" for c in cells)
            lines.append(f"rank {rank:>2} | {row.rstrip()}")
        return "\n".join(lines)

    def summary(self) -> str:
        """Bubble, per-rank idle fraction and peak in-flight micro-batches, as text."""
        s = self.schedule
        head = (
            f"schedule={s.name} pp={s.pp} vpp={s.vpp} microbatches={s.microbatches}"
            f" (forward {self.forward_time}, backward {self.backward_time} per micro-batch"
            f" and rank)"
        )
        rows = [
            f"rank {r:>2}: idle {float(self.idle[r]):6.1%}  peak in-flight"
            f" {self.peak_in_flight[r]} micro-batch chunks"
            for r in range(s.pp)
        ]
        flat = textbook_bubble(s.pp, s.microbatches)
        textbook = f"GPipe/1F1B textbook (p-1)/(m+p-1) = {float(flat):.1%}"
        if s.vpp > 1:
            interleaved = textbook_bubble(s.pp, s.microbatches, s.vpp)
            textbook += f"; interleaved (p-1)/(v*m+p-1) = {float(interleaved):.1%}"
        tail = (
            f"makespan {float(self.makespan):g}, bubble {float(self.bubble_fraction):.1%}"
            f" ({textbook}), p2p order matched: {self.p2p_in_order}"
        )
        return "\n".join([head, *rows, tail])


def textbook_bubble(pp: int, microbatches: int, vpp: int = 1) -> Fraction:
    """``(p - 1) / (v * m + p - 1)``: the bubble fraction of GPipe/1F1B (v = 1) and of the
    interleaved schedule with ``v`` chunks (Narayanan et al., 2021, §2.2)."""
    return Fraction(pp - 1, vpp * microbatches + pp - 1)


def _gcd_time(timeline: list[list[TimeSlot]]) -> Fraction:
    from math import gcd, lcm

    times = [t for rank in timeline for slot in rank for t in (slot.start, slot.end)]
    den = lcm(*(t.denominator for t in times)) if times else 1
    num = 0
    for t in times:
        num = gcd(num, int(t * den))
    return Fraction(num or 1, den)


def _dependencies(kind: str, stage: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    deps = [("F", stage, mb)]
    if stage < last:
        deps.append(("B", stage + 1, mb))
    return deps


def check_complete(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless every rank runs each forward (and backward) exactly once."""
    s = schedule
    if len(s.actions) != s.pp:
        raise ValueError(f"The {s.name} schedule has {len(s.actions)} action lists for pp={s.pp}.")
    kinds = ("F",) if s.forward_only else ("F", "B")
    expected = {(k, m, c) for k in kinds for m in range(s.microbatches) for c in range(s.vpp)}
    for rank, actions in enumerate(s.actions):
        seen = [(a.kind, a.microbatch, a.chunk) for a in actions]
        if len(seen) != len(set(seen)) or set(seen) != expected:
            missing = sorted(expected - set(seen))
            dupes = sorted({x for x in seen if seen.count(x) > 1})
            extra = sorted(set(seen) - expected)
            raise ValueError(
                f"rank {rank} of the {s.name} schedule: missing {missing}, repeated {dupes}"
                + (f", unexpected {extra}." if extra else ".")
            )


def simulate(
    schedule: Schedule,
    forward_time: Fraction | int = 1,
    backward_time: Fraction | int = 2,
) -> Simulation:
    """Execute every rank's action list symbolically, as the executor would.

    An action starts when its rank is free and its inputs exist (the previous stage's
    forward for a forward; this stage's forward and the next stage's backward for a
    backward). Communication takes no time. A micro-batch's forward through one chunk
    takes ``forward_time / vpp`` (a chunk holds ``1/vpp`` of the rank's layers).

    Raises:
        ValueError: If an action is missing or repeated.
        DeadlockError: If the ranks end up waiting for each other, naming each stuck action.
    """
    check_complete(schedule)
    s = schedule
    durations = {
        "F": Fraction(forward_time) / s.vpp,
        "B": Fraction(backward_time) / s.vpp,
    }
    last = s.num_stages - 1
    done: dict[tuple[str, int, int], Fraction] = {}
    timeline: list[list[TimeSlot]] = [[] for _ in range(s.pp)]
    clock = [Fraction(0)] * s.pp
    cursor = [0] * s.pp
    progress = True
    while progress:
        progress = False
        for rank in range(s.pp):
            while cursor[rank] < len(s.actions[rank]):
                action = s.actions[rank][cursor[rank]]
                stage = s.stage_of(rank, action.chunk)
                deps = _dependencies(action.kind, stage, action.microbatch, last)
                if s.forward_only:
                    deps = [d for d in deps if d[0] == "F"]
                if any(d not in done for d in deps):
                    break
                start = max([clock[rank], *(done[d] for d in deps)])
                end = start + durations[action.kind]
                done[(action.kind, stage, action.microbatch)] = end
                timeline[rank].append(TimeSlot(action, stage, start, end))
                clock[rank] = end
                cursor[rank] += 1
                progress = True
    _raise_if_stuck(s, cursor)
    busy = [sum((slot.end - slot.start for slot in rank), Fraction(0)) for rank in timeline]
    return Simulation(
        schedule=s,
        timeline=timeline,
        makespan=max(clock),
        busy=busy,
        peak_in_flight=[_peak_in_flight(actions) for actions in s.actions],
        p2p_in_order=_p2p_in_order(s),
        forward_time=Fraction(forward_time),
        backward_time=Fraction(backward_time),
    )


def _raise_if_stuck(schedule: Schedule, cursor: list[int]) -> None:
    """Raise a ``DeadlockError`` naming each rank's first action that never ran."""
    stuck = {
        rank: actions[cursor[rank]]
        for rank, actions in enumerate(schedule.actions)
        if cursor[rank] < len(actions)
    }
    if stuck:
        detail = ", ".join(f"rank {r} waits at {a}" for r, a in stuck.items())
        raise DeadlockError(f"The {schedule.name} schedule deadlocks: {detail}.")


def _peak_in_flight(actions: list[Action]) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _p2p_in_order(schedule: Schedule) -> bool:
    """Whether each directed link's messages are consumed in the order they are produced.

    Activations and gradients share a link (with ``vpp > 1`` a rank sends both to the
    same peer), as they share one channel on backends that match messages by order
    rather than by tag (NCCL).
    """
    s = schedule
    last = s.num_stages - 1
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for rank, actions in enumerate(s.actions):
        for action in actions:
            stage = s.stage_of(rank, action.chunk)
            mb = action.microbatch
            if action.kind == "F":
                if stage < last:
                    sent[(rank, s.rank_of(stage + 1)[0])].append(("F", stage, mb))
                if stage > 0:
                    received[(s.rank_of(stage - 1)[0], rank)].append(("F", stage - 1, mb))
            else:
                if stage > 0:
                    sent[(rank, s.rank_of(stage - 1)[0])].append(("B", stage, mb))
                if stage < last:
                    received[(s.rank_of(stage + 1)[0], rank)].append(("B", stage + 1, mb))
    return dict(sent) == dict(received)


# ---- when a sent tensor may be released ---------------------------------------------------

Message = tuple[str, int, int]
"""``(kind, producing stage, micro-batch)``: one activation (``F``) or gradient (``B``)."""


def _messages(s: Schedule, rank: int, action: Action) -> tuple[Message | None, Message | None]:
    """The message ``action`` receives (first) and the one it sends (after computing)."""
    stage, mb, last = s.stage_of(rank, action.chunk), action.microbatch, s.num_stages - 1
    if action.kind == "F":
        received = ("F", stage - 1, mb) if stage > 0 else None
        return received, (("F", stage, mb) if stage < last else None)
    received = ("B", stage + 1, mb) if stage < last else None
    return received, (("B", stage, mb) if stage > 0 else None)


def _destination(s: Schedule, message: Message) -> int:
    kind, stage, _ = message
    return s.rank_of(stage + 1 if kind == "F" else stage - 1)[0]


def release_points(schedule: Schedule, rank: int) -> dict[int, list[Message]]:
    """For each of ``rank``'s actions, the messages it sent earlier that are certainly
    delivered once that action's receive has completed.

    A message is delivered when its receiver's action runs. Anything the receiver sends
    back to us from that action on was sent after it, so when our receive of such a
    message completes, the earlier send has completed too: waiting on it then returns
    at once, on gloo and on NCCL alike (where a send completes only when its receive is
    posted). Messages with no such answer are released at the end of the step.

    Returns:
        Our action index -> the messages whose sends to release after that action.
    """
    s = schedule
    receiver_index: dict[Message, tuple[int, int]] = {}  # message -> (rank, action index)
    sent_from: list[list[tuple[int, Message]]] = [[] for _ in range(s.pp)]
    for r, actions in enumerate(s.actions):
        for index, action in enumerate(actions):
            received, sent = _messages(s, r, action)
            if received is not None:
                receiver_index[received] = (r, index)
            if sent is not None:
                sent_from[r].append((index, sent))
    releases: dict[int, list[Message]] = defaultdict(list)
    answers: dict[int, tuple[list[int], list[int]]] = {}
    for _index, message in sent_from[rank]:
        if s.forward_only and message[0] == "B":
            continue
        peer, consumed_at = receiver_index[message]
        if peer not in answers:
            answers[peer] = _answers(s, sent_from[peer], receiver_index, rank)
        sent_at, first_received = answers[peer]
        k = bisect.bisect_left(sent_at, consumed_at)
        if k < len(sent_at):
            releases[first_received[k]].append(message)
    return dict(releases)


def _answers(
    s: Schedule,
    peer_sends: list[tuple[int, Message]],
    receiver_index: dict[Message, tuple[int, int]],
    rank: int,
) -> tuple[list[int], list[int]]:
    """The action indices at which a peer sends to ``rank`` and, for each, the earliest of
    ``rank``'s receives among that send and the later ones (a suffix minimum)."""
    replies = [(i, receiver_index[m][1]) for i, m in peer_sends if _destination(s, m) == rank]
    first_received = [index for _, index in replies]
    for k in range(len(first_received) - 2, -1, -1):
        first_received[k] = min(first_received[k], first_received[k + 1])
    return [i for i, _ in replies], first_received
