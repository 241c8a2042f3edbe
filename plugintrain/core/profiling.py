"""Named wall-clock ranges of a training step: forward, backward, optimizer, communication.

Code that does one of the step's jobs wraps it in :func:`record`::

    with profiling.record(GRAD_REDUCE_SCATTER):
        work.wait()

When no :class:`Recorder` is active (the default) ``record`` checks one module-level
variable and returns a shared no-op context, so the ranges can sit in the hot paths of
every strategy. :func:`recording` activates a recorder (the
:class:`~plugintrain.callbacks.PhaseProfiler` callback does, one training step at a time);
each range then

- measures wall-clock time on this rank, per thread (on CUDA the autograd engine runs
  backward, and so the gradient hooks, in a thread of its own);
- opens a ``torch.profiler.record_function`` of the same name, so the ranges show up in
  Lightning's ``pytorch`` profiler and any ``torch.profiler`` trace;
- on CUDA also pushes an NVTX range (Nsight Systems), and synchronizes the current stream
  at both ends, so a range covers the kernels it launched and not only their launch.
  Collectives and point-to-point transfers run on NCCL's own streams; their ``wait()``
  makes the current stream wait, so a range around a ``wait()`` measures the time the
  step is held up by the communication (its exposed part), as on gloo, where the host
  blocks. The synchronization is paid only while recording.

Communication ranges cover waiting for the transfer to complete, not issuing it: issuing
takes microseconds, while the wait is the part of the communication the step cannot hide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

import torch

TRAIN_STEP: Final = "train_step"
FORWARD: Final = "forward"
BACKWARD: Final = "backward"
OPTIMIZER: Final = "optimizer"
GRAD_ALL_REDUCE: Final = "grad_all_reduce"
GRAD_REDUCE_SCATTER: Final = "grad_reduce_scatter"
GRAD_REDUCE: Final = "grad_reduce"
PARAM_ALL_GATHER: Final = "param_all_gather"
PARAM_BROADCAST: Final = "param_broadcast"
PIPELINE_POST: Final = "pipeline_post"
PIPELINE_RECV_WAIT: Final = "pipeline_recv_wait"
PIPELINE_SEND_WAIT: Final = "pipeline_send_wait"
EXPERT_ALL_TO_ALL: Final = "expert_all_to_all"

PHASES: Final[dict[str, str]] = {
    TRAIN_STEP: "one training batch, from Lightning's on_train_batch_start to its end",
    FORWARD: "forward and loss (per micro-batch and virtual stage under a pipeline)",
    BACKWARD: "backward (per micro-batch and virtual stage under a pipeline)",
    OPTIMIZER: "clipping, the optimizer step and the parameter sync after it",
    GRAD_ALL_REDUCE: "waiting for a gradient bucket's all-reduce (ZeRO 0/1, DDP-style)",
    GRAD_REDUCE_SCATTER: "waiting for a gradient bucket's reduce-scatter (ZeRO-2)",
    GRAD_REDUCE: "waiting for a gradient bucket's reduce to rank 0 (parameter server)",
    PARAM_ALL_GATHER: "waiting for a bucket's updated parameters' all-gather (ZeRO 1/2)",
    PARAM_BROADCAST: "waiting for a bucket's parameters' broadcast (parameter server)",
    PIPELINE_POST: "posting one batch of pipeline sends and receives",
    PIPELINE_RECV_WAIT: "waiting for one pipeline activation or gradient to arrive",
    PIPELINE_SEND_WAIT: "waiting for one sent pipeline tensor to be delivered",
    EXPERT_ALL_TO_ALL: "one MoE layer's token exchange over the expert-parallel ranks"
    " (counts and tokens out, or outputs back)",
}
"""The ranges plugintrain records, by name (the :func:`record` names used in the code)."""

_OFF: Final = nullcontext()


@dataclass(frozen=True)
class Range:
    """One recorded range.

    Attributes:
        name: The phase (a key of :data:`PHASES`, or a user's own name).
        start_ns: Wall-clock start, nanoseconds since the epoch (comparable across ranks
            as far as their clocks agree).
        duration_ns: Length in nanoseconds.
        thread: Small per-process thread number (0: the first thread that recorded).
        parent: Name of the range it is nested in on its thread, None at the top.
        step: The recorder's step counter when the range began.
    """

    name: str
    start_ns: int
    duration_ns: int
    thread: int
    parent: str | None
    step: int


@dataclass
class Recorder:
    """Collects the ranges of this process while active (see :func:`recording`).

    Args:
        device: The device the step runs on; on CUDA ranges emit NVTX and synchronize.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ranges: list[Range] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        # perf_counter is monotonic; the offset turns it into wall-clock time once.
        self._epoch_offset = time.time_ns() - time.perf_counter_ns()
        self._local = threading.local()
        self._threads: dict[int, int] = {}
        self._lock = threading.Lock()

    def stack(self) -> list[str]:
        """The names of this thread's open ranges, outermost first."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def thread_number(self) -> int:
        """A small number for the calling thread, stable for the recorder's life."""
        ident = threading.get_ident()
        with self._lock:
            return self._threads.setdefault(ident, len(self._threads))

    def now_ns(self) -> int:
        """Wall-clock nanoseconds, after the current CUDA stream's work so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter_ns() + self._epoch_offset

    def add(self, name: str, start_ns: int, end_ns: int, parent: str | None) -> None:
        """Record a finished range (``list.append`` is atomic: safe from any thread)."""
        self.ranges.append(
            Range(name, start_ns, end_ns - start_ns, self.thread_number(), parent, self.step)
        )


class _Range(AbstractContextManager):
    """An open range of the active recorder; also usable across hooks (enter in one hook,
    exit in a later one) by calling ``__enter__``/``__exit__`` directly."""

    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name
        self._function = torch.profiler.record_function(name)

    def __enter__(self) -> _Range:
        stack = self.recorder.stack()
        self.parent = stack[-1] if stack else None
        stack.append(self.name)
        self._function.__enter__()
        if self.recorder.cuda:
            torch.cuda.nvtx.range_push(self.name)
        self.start_ns = self.recorder.now_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        end_ns = self.recorder.now_ns()
        if self.recorder.cuda:
            torch.cuda.nvtx.range_pop()
        self._function.__exit__(*exc)
        self.recorder.stack().pop()
        self.recorder.add(self.name, self.start_ns, end_ns, self.parent)


_active: Recorder | None = None


def device_seconds(device: torch.device) -> float:
    """Wall-clock seconds once ``device`` has finished everything queued on it (every CUDA
    stream, NCCL's included): the clock for timing whole steps, which ranges do not need."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def record(name: str) -> AbstractContextManager:
    """A range named ``name`` in the active recorder; a shared no-op when none is active."""
    recorder = _active
    if recorder is None:
        return _OFF
    return _Range(recorder, name)


def active() -> Recorder | None:
    """The recorder ranges go to right now, if any."""
    return _active


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Send every :func:`record` range of this process to ``recorder`` inside the block."""
    start(recorder)
    try:
        yield recorder
    finally:
        stop()


def start(recorder: Recorder) -> None:
    """Make ``recorder`` the active one (until :func:`stop`)."""
    global _active
    _active = recorder


def stop() -> None:
    """Stop recording; :func:`record` is a no-op again."""
    global _active
    _active = None


@runtime_checkable
class RecordsComputeRanges(Protocol):
    """A strategy that runs forward and backward itself (a pipeline) and records their
    ``forward``/``backward`` ranges, per micro-batch; a profiler callback then records only
    the step and the optimizer around it."""

    @property
    def records_compute_ranges(self) -> bool:
        """Whether this strategy's steps record ``forward`` and ``backward`` themselves."""
        ...


@dataclass(frozen=True)
class PhaseTotal:
    """Count and total seconds of one phase on one rank."""

    count: int
    seconds: float


def phase_totals(ranges: list[Range]) -> dict[str, PhaseTotal]:
    """Per phase name: how many ranges and their total length, in first-seen order."""
    counts: dict[str, int] = {}
    totals: dict[str, int] = {}
    for r in ranges:
        counts[r.name] = counts.get(r.name, 0) + 1
        totals[r.name] = totals.get(r.name, 0) + r.duration_ns
    return {name: PhaseTotal(counts[name], totals[name] / 1e9) for name in counts}


def chrome_trace(ranges: list[Range], rank: int) -> dict[str, Any]:
    """The ranges as a Chrome trace (JSON trace-event format: complete ``X`` events with
    ``ts``/``dur`` in microseconds, ``pid`` the rank), loadable in Perfetto or
    ``chrome://tracing``; traces of several ranks can be concatenated into one view."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    for r in ranges:
        events.append(
            {
                "name": r.name,
                "cat": _category(r.name),
                "ph": "X",
                "ts": r.start_ns / 1e3,
                "dur": r.duration_ns / 1e3,
                "pid": rank,
                "tid": r.thread,
                "args": {"step": r.step},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _category(name: str) -> str:
    if name.startswith(("grad_", "param_", "pipeline_")):
        return "communication"
    return "step" if name == TRAIN_STEP else "compute"
