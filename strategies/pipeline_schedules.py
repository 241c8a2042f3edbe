"""Pipeline schedules as data, and a simulator that runs them symbolically.

A schedule is one ordered list of :class:`Action` per pipeline rank: forward or backward
of one micro-batch through one of the rank's model chunks. Communication is implied by
the actions, as the executor (:mod:`plugintrain.strategies.pipeline_executor`) performs it: the
forward of virtual stage ``s > 0`` receives its input from stage ``s - 1``, a forward
that is not the last stage sends its output on, and backward runs the other way.
Where sends never wait (gloo), a schedule can only hang on a cycle of data
dependencies, which :func:`simulate` detects. Where a send completes only once its
receive is posted (NCCL, beyond its eager threshold), two neighbours that send to each
other first hang; :func:`p2p_plan` groups each rank's transfers into the batches the
executor posts together, and :func:`check_rendezvous` (``simulate(...,
rendezvous=True)``) proves that those batches complete under that rule.

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
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import accumulate
from typing import Literal, NamedTuple

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
    (so the executor's transfers also match on backends that ignore tags, like NCCL)."""
    forward_time: Fraction = Fraction(1)
    backward_time: Fraction = Fraction(2)
    rendezvous: bool = False
    """Whether the executor's batches also ran to the end with each send waiting for its
    receive (NCCL's large messages); where they hang, :func:`simulate` raises."""
    stage_times: list[tuple[Fraction, Fraction]] | None = None
    """Per virtual stage forward and backward times, where stages were not equal."""
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
        head = f"schedule={s.name} pp={s.pp} vpp={s.vpp} microbatches={s.microbatches}"
        if self.stage_times is None:
            head += (
                f" (forward {self.forward_time}, backward {self.backward_time} per"
                " micro-batch and rank)"
            )
        else:
            times = ", ".join(f"{float(f):g}/{float(b):g}" for f, b in self.stage_times)
            head += f" (forward/backward per micro-batch and stage: {times})"
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
        if self.rendezvous:
            tail += ", deadlock-free when sends wait for their receives (NCCL)"
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
    rendezvous: bool = False,
    stage_times: Sequence[tuple[Fraction | int, Fraction | int]] | None = None,
) -> Simulation:
    """Execute every rank's action list symbolically, as the executor would.

    An action starts when its rank is free and its inputs exist (the previous stage's
    forward for a forward; this stage's forward and the next stage's backward for a
    backward). Communication takes no time and sends never wait, as on gloo. A
    micro-batch's forward through one chunk takes ``forward_time / vpp`` (a chunk holds
    ``1/vpp`` of the rank's layers).

    Args:
        schedule: The schedule to run.
        forward_time: One micro-batch's forward through all of a rank's layers.
        backward_time: The same for a backward.
        rendezvous: Also run the batches the executor posts (:func:`p2p_plan`) where
            each send waits for its receive, as on NCCL (:func:`check_rendezvous`).
        stage_times: Per virtual stage, one micro-batch's forward and backward time
            through that stage (unequal stages: a heavier head, a measured split); replaces
            ``forward_time`` and ``backward_time``.

    Raises:
        ValueError: If an action is missing or repeated.
        DeadlockError: If the ranks end up waiting for each other, naming each stuck action.
    """
    check_complete(schedule)
    s = schedule
    unequal = stage_times is not None
    if stage_times is None:
        equal = (Fraction(forward_time) / s.vpp, Fraction(backward_time) / s.vpp)
        stage_times = [equal] * s.num_stages
    elif len(stage_times) != s.num_stages:
        raise ValueError(f"stage_times has {len(stage_times)} entries for {s.num_stages} stages")
    timeline = _timeline(s, [(Fraction(f), Fraction(b)) for f, b in stage_times])
    if rendezvous:
        check_rendezvous(s)
    busy = [sum((slot.end - slot.start for slot in rank), Fraction(0)) for rank in timeline]
    return Simulation(
        schedule=s,
        timeline=timeline,
        makespan=max(rank[-1].end if rank else Fraction(0) for rank in timeline),
        busy=busy,
        peak_in_flight=[_peak_in_flight(actions) for actions in s.actions],
        p2p_in_order=_p2p_in_order(s),
        forward_time=Fraction(forward_time),
        backward_time=Fraction(backward_time),
        rendezvous=rendezvous,
        stage_times=None if not unequal else [(Fraction(f), Fraction(b)) for f, b in stage_times],
    )


def _timeline(s: Schedule, stage_times: list[tuple[Fraction, Fraction]]) -> list[list[TimeSlot]]:
    """Each rank's actions placed in time, each as soon as its rank and inputs allow."""
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
                end = start + stage_times[stage][action.kind == "B"]
                done[(action.kind, stage, action.microbatch)] = end
                timeline[rank].append(TimeSlot(action, stage, start, end))
                clock[rank] = end
                cursor[rank] += 1
                progress = True
    _raise_if_stuck(s, cursor)
    return timeline


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


# ---- what a rank posts, and the rendezvous check -----------------------------------------


class Transfer(NamedTuple):
    """One point-to-point operation of a rank: the send or the receive of one message."""

    op: Literal["send", "recv"]
    message: Message
    peer: int
    """The pipeline rank at the other end."""

    def __str__(self) -> str:
        kind, stage, mb = self.message
        way = "to" if self.op == "send" else "from"
        return f"{self.op} {kind}{mb} of stage {stage} {way} rank {self.peer}"


Batch = tuple[Transfer, ...]
"""Transfers posted together (one ``batch_isend_irecv``): none of them waits for another."""


def p2p_plan(schedule: Schedule) -> list[list[Batch]]:
    """What each rank posts around its actions; the executor posts exactly this.

    ``plan[rank][i]`` is posted just before the rank's action ``i`` (``plan[rank][-1]``
    after its last): the send of what action ``i - 1`` produced, posted together with
    the receive that action ``i`` needs. Where a send completes only once its receive is
    posted (NCCL beyond its eager threshold), two lone sends hang: in 1F1B's steady state
    stage s sends an activation to s + 1 while s + 1 sends a gradient to s, each waiting
    for a receive queued behind the other's send (NVIDIA/nccl#479). Batched, both
    exchanges proceed, as Megatron-LM's ``send_forward_recv_backward`` and
    ``send_backward_recv_forward`` (``p2p_communication.py``) do.

    That suffices for GPipe and 1F1B. With ``vpp > 1`` the ranks form a ring, and a
    rank's send can meet a peer that sends to it first and receives only an action
    later (rank 0 of pp = 2 sends a gradient after B0.1 alone, as F3 on stage 0 receives
    nothing, while rank 1 sends one after B1.1). So the batches are run as
    :func:`check_rendezvous` runs them, and wherever all ranks wait, the receive of one
    waiting send is posted earlier, with the batch its receiver waits at, until they run
    to the end. A gradient's receive is moved first (it reuses the buffer of a finished
    backward), else the activation of the rank that holds the fewest micro-batches then.
    In training such a receive comes one action early, so a rank holds at most one
    received buffer more (like Megatron's four-transfer batches in the interleaved
    steady state), and none at its peak in the cases ``test_memory.py`` measures;
    evaluation with ``vpp > 1`` receives the last rank's chunk-0 outputs while rank 0
    still runs chunk 0. Sends are never held back.

    Raises:
        DeadlockError: If no batching lets the schedule run (a cycle of data
            dependencies, which :func:`simulate` names).
    """
    s = schedule
    plans = [_just_in_time(s, rank) for rank in range(s.pp)]
    held = [
        list(accumulate((1 if a.kind == "F" else -1 for a in actions), initial=0))
        for actions in s.actions
    ]
    run = _Rendezvous(plans)
    stuck = run.advance()
    while stuck:
        run.post_a_receive_early(stuck, held)
        stuck = run.advance()
    return run.batches()


def _just_in_time(s: Schedule, rank: int) -> list[list[Transfer]]:
    """Entry ``i``: the send of action ``i - 1`` and the receive of action ``i``."""
    before, after = (rank - 1) % s.pp, (rank + 1) % s.pp  # the ranks of stages s -+ 1
    batches: list[list[Transfer]] = []
    pending: list[Transfer] = []  # the previous action's send
    for action in s.actions[rank]:
        received, sent = _messages(s, rank, action)
        forward = action.kind == "F"
        receive = (
            [] if received is None else [Transfer("recv", received, before if forward else after)]
        )
        batches.append(pending + receive)
        pending = [] if sent is None else [Transfer("send", sent, after if forward else before)]
    batches.append(pending)
    return batches


def check_rendezvous(schedule: Schedule, plan: Sequence[Sequence[Batch]] | None = None) -> None:
    """Raise a ``DeadlockError`` unless every rank's batches complete where each send
    waits for its receive (rendezvous), as NCCL's do beyond its eager threshold.

    A batch completes once every transfer in it has its counterpart posted on the peer:
    a send its receive, a receive its send, the n-th send on a link meeting the n-th
    receive (NCCL matches by order and ignores tags). A rank posts its next batch only
    once the previous one completed, so a lone send blocks its rank, as on the one NCCL
    stream that carries a rank's batches; the transfers of one batch never wait for each
    other. Computation is left out: an action needs nothing beyond its batches.

    Args:
        schedule: The schedule the batches belong to.
        plan: Each rank's batches in posting order; None: :func:`p2p_plan`, what the
            executor posts.
    """
    plans = plan or p2p_plan(schedule)
    run = _Rendezvous(plans)
    stuck = run.advance()
    if stuck:
        detail = ", ".join(
            f"rank {r} waits at [{' + '.join(map(str, plans[r][run.cursor[r]]))}]" for r in stuck
        )
        raise DeadlockError(
            f"The {schedule.name} schedule deadlocks when a send waits for its receive: {detail}."
        )


class _Rendezvous:
    """All ranks' batches, run symbolically with each send waiting for its receive.

    A rank completes the batch it has reached once every transfer in it has its
    counterpart posted, in a batch its peer has reached; the n-th send on a link meets
    the n-th receive. Transfers are numbered in plan order (``transfers[t]``):
    ``numbers[rank][i]`` are those of batch ``i``, transfer ``t`` sits in batch
    ``where[t]`` of rank ``owner[t]`` and meets transfer ``other[t]`` (None: nobody posts
    it). ``unmet[rank][i]`` counts what batch ``i`` still waits for: its rank to reach
    it, and each counterpart.
    """

    def __init__(self, plans: Sequence[Sequence[Sequence[Transfer]]]) -> None:
        self.cursor = [0] * len(plans)
        self.transfers = [t for batches in plans for batch in batches for t in batch]
        self.where: list[int] = []
        self.owner: list[int] = []
        self.numbers: list[list[list[int]]] = []
        on_link: dict[tuple[str, int, int], list[int]] = defaultdict(list)  # in plan order
        for rank, batches in enumerate(plans):
            self.numbers.append([])
            for index, batch in enumerate(batches):
                first = len(self.where)
                self.numbers[rank].append(list(range(first, first + len(batch))))
                self.where += [index] * len(batch)
                self.owner += [rank] * len(batch)
                for t, (op, _, peer) in enumerate(batch, first):
                    on_link[(op, rank, peer) if op == "send" else (op, peer, rank)].append(t)
        self.other: list[int | None] = [None] * len(self.where)
        for (op, src, dst), numbers in list(on_link.items()):
            counterparts = on_link[("recv" if op == "send" else "send", src, dst)]
            for t, u in zip(numbers, counterparts, strict=False):
                self.other[t] = u
        self.unmet = [[len(b) + (i > 0) for i, b in enumerate(batches)] for batches in plans]
        self.ready: deque[int] = deque(r for r, b in enumerate(plans) if b and not b[0])
        for rank, batches in enumerate(plans):
            if batches:
                self._reach(rank)

    def _reach(self, rank: int) -> None:
        """``rank`` has reached its batch ``cursor[rank]``: its transfers are posted."""
        index, other, unmet = self.cursor[rank], self.other, self.unmet
        waiting = [(rank, index)] if index else []  # the batch waited for its rank
        for t in self.numbers[rank][index]:
            u = other[t]
            if u is not None:
                waiting.append((self.owner[u], self.where[u]))  # and u for t
        for peer, at in waiting:
            unmet[peer][at] -= 1
            if not unmet[peer][at]:  # a batch its rank has reached: it can complete
                self.ready.append(peer)

    def advance(self) -> list[int]:
        """Complete batches while any can; the ranks left waiting."""
        while self.ready:
            rank = self.ready.popleft()
            self.cursor[rank] += 1
            if self.cursor[rank] < len(self.numbers[rank]):
                self._reach(rank)
        return [r for r, c in enumerate(self.cursor) if c < len(self.numbers[r])]

    def post_a_receive_early(self, stuck: list[int], held: list[list[int]]) -> None:
        """Move the receive of one waiting send into the batch its receiver waits at,
        which lets that send complete. Which one: a gradient's if any (it goes into a
        buffer a finished backward left), else the activation of the receiver that holds
        the fewest micro-batches then (``held[rank][i]``: before its action ``i``)."""
        waiting = []
        for rank in stuck:
            index = self.cursor[rank]
            for u in self.numbers[rank][index]:
                transfer, t = self.transfers[u], self.other[u]
                if transfer.op == "send" and t is not None:
                    peer = self.owner[t]
                    if self.where[t] > self.cursor[peer]:  # not posted yet
                        cost = (transfer.message[0] == "F", held[peer][self.cursor[peer]])
                        waiting.append((cost, rank, u))
        if not waiting:
            raise DeadlockError(f"Ranks {stuck} wait on each other's data: no batching helps.")
        _, rank, u = min(waiting)
        t = self.other[u]
        assert t is not None
        self._move(self.owner[t], t, self.cursor[self.owner[t]])
        self.unmet[rank][self.cursor[rank]] -= 1
        if self.unmet[rank][self.cursor[rank]] == 0:
            self.ready.append(rank)

    def _move(self, rank: int, number: int, new: int) -> None:
        """Move transfer ``number`` of ``rank`` to the end of its batch ``new``."""
        old = self.where[number]
        at = self.numbers[rank][old].index(number)
        self.numbers[rank][new].append(self.numbers[rank][old].pop(at))
        self.where[number] = new

    def batches(self) -> list[list[Batch]]:
        """Each rank's batches, as they stand."""
        transfers = self.transfers
        return [[tuple([transfers[t] for t in batch]) for batch in rank] for rank in self.numbers]
