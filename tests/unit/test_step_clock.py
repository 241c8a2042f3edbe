"""The pipeline's step clock: host time on the CPU, CUDA events where ``wait()`` does not
block the host (NCCL), read only when asked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from plugintrain.strategies.pipeline_executor import StepClock


class _FakeEvent:
    """A CUDA timing event on a scripted device timeline: each ``record`` takes the next
    time (milliseconds), as the stream reaches it."""

    def __init__(self, timeline: Iterator[float], log: list[str]) -> None:
        self.timeline, self.log = timeline, log
        self.at: float | None = None

    def record(self) -> None:
        self.at = next(self.timeline)
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        assert self.log[-1] == "synchronize", "read only once the later event has happened"
        return end.at - self.at


def test_on_cuda_waits_and_the_step_are_read_from_events() -> None:
    log: list[str] = []
    timeline = iter([0.0, 10.0, 15.0, 40.0, 47.0, 100.0, 200.0])  # ms: start, 2 waits, stop
    clock = StepClock(lambda: _FakeEvent(timeline, log))
    clock.start(torch.device("cuda"))
    for _ in range(2):
        with clock.waiting():
            pass  # NCCL's wait() returns at once; the stream waits
    clock.stop()
    assert "synchronize" not in log  # the step itself is never synchronized
    assert clock.wait_seconds == pytest.approx((5.0 + 7.0) / 1000)
    assert clock.step_seconds == pytest.approx(0.1)
    clock.start(torch.device("cuda"))  # a new step starts from zero
    assert clock.wait_seconds == 0.0


def test_on_the_cpu_the_host_blocks_and_is_timed() -> None:
    clock = StepClock(lambda: pytest.fail("no events off CUDA"))
    clock.start(torch.device("cpu"))
    with clock.waiting():
        time.sleep(0.02)
    clock.stop()
    assert 0.02 <= clock.wait_seconds <= clock.step_seconds
