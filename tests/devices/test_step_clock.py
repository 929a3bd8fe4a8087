"""The step clocks (devices/base.py): a GPU's, driven here by fake events on a
clock the test sets, and the host's, against sleeps the test makes.

NOTE [the step's bound]: the device's compute is the span less the idle time inside
the engine's brackets; a GPU's copies are timed per direction. The event clock is
what CUDA runs; these tests are how CI sees it without a GPU.
"""

from __future__ import annotations

import time

from infinity.devices.base import FOLD_AT, EventClock, HostClock


class FakeGPU:
    """A GPU timeline in milliseconds: an event recorded now completes at ``now``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.finished = True
        self.made = 0  # events created (not recorded again)

    def record(self, reuse: FakeEvent | None = None) -> FakeEvent:
        if reuse is not None:
            assert reuse.read, "an event recorded again before its time was read"
            reuse.at, reuse.read = self.now, False
            return reuse
        self.made += 1
        return FakeEvent(self, self.now)


class FakeEvent:
    def __init__(self, gpu: FakeGPU, at: float) -> None:
        self.gpu, self.at = gpu, at
        self.read = False

    def query(self) -> bool:
        return self.gpu.finished

    def synchronize(self) -> None:
        assert self.gpu.finished, "read before the GPU reached it"

    def elapsed_time(self, end: FakeEvent) -> float:
        self.read = end.read = True
        return end.at - self.at


def test_compute_is_the_span_less_the_idle_time_inside_brackets() -> None:
    gpu = FakeGPU()
    clock = EventClock(gpu.record)
    clock.open_span()  # t = 0
    gpu.now = 10.0
    with clock.stall():  # the GPU idles from 10 to 15 ms for the engine
        with clock.stall():  # nested: counted once, by the outermost
            gpu.now = 12.0
        gpu.now = 15.0
    gpu.now = 40.0
    clock.open_span()  # a second forward (accumulation) continues the span
    with clock.stall():
        gpu.now = 41.0
    gpu.now = 50.0
    seconds = clock.close_span()
    assert abs(seconds() - (50.0 - 5.0 - 1.0) / 1e3) < 1e-12
    with clock.stall():  # outside a span: nothing to count, nothing recorded
        gpu.now = 60.0
    clock.open_span()
    gpu.now = 70.0
    assert abs(clock.close_span()() - 10.0 / 1e3) < 1e-12


def test_many_brackets_are_folded_without_losing_time() -> None:
    gpu = FakeGPU()
    clock = EventClock(gpu.record)
    clock.open_span()
    for _ in range(FOLD_AT + 10):
        with clock.stall():
            gpu.now += 1.0
        gpu.now += 2.0
    brackets = FOLD_AT + 10
    seconds = clock.close_span()()
    assert abs(seconds - 2.0 * brackets / 1e3) < 1e-9


def test_copies_are_timed_per_direction_and_taken_once() -> None:
    gpu = FakeGPU()
    clock = EventClock(gpu.record)
    for to_device, start, ms in [(True, 0.0, 2.0), (False, 1.0, 3.0), (True, 5.0, 0.5)]:
        clock.copied(to_device, FakeEvent(gpu, start), FakeEvent(gpu, start + ms))
    h2d, d2h = clock.take_link_seconds()()
    assert abs(h2d - 2.5e-3) < 1e-12 and abs(d2h - 3e-3) < 1e-12
    assert clock.take_link_seconds()() == (0.0, 0.0)


def test_folding_copies_keeps_the_unfinished_ones() -> None:
    gpu = FakeGPU()
    clock = EventClock(gpu.record)
    for k in range(FOLD_AT):
        clock.copied(True, FakeEvent(gpu, k), FakeEvent(gpu, k + 1.0))
    gpu.finished = False  # the next ones are still in flight when the fold runs
    clock.copied(False, FakeEvent(gpu, 0.0), FakeEvent(gpu, 4.0))
    gpu.finished = True
    h2d, d2h = clock.take_link_seconds()()
    assert abs(h2d - FOLD_AT / 1e3) < 1e-9 and abs(d2h - 4e-3) < 1e-12


def test_the_host_clock_leaves_bracketed_waits_out() -> None:
    clock = HostClock()
    start = time.perf_counter()
    clock.open_span()
    with clock.stall():
        time.sleep(0.05)
    busy = time.perf_counter()
    while time.perf_counter() - busy < 0.02:  # the "device" computing
        pass
    seconds = clock.close_span()()
    elapsed = time.perf_counter() - start
    assert 0.02 <= seconds < elapsed - 0.045
    assert clock.take_link_seconds() is None


def test_events_go_back_to_the_clock_once_read_and_a_lap_reads_once() -> None:
    """The brackets record about a thousand events a step: read ones are recorded
    again, so steps whose laps are read create none, and every time stays right."""
    gpu = FakeGPU()
    refreshed = []
    clock = EventClock(gpu.record, lambda: refreshed.append(gpu.now))
    made = []
    for _ in range(4):
        clock.open_span()
        for _bracket in range(50):
            with clock.stall():
                gpu.now += 1.0
            gpu.now += 3.0
        seconds = clock.close_span()
        assert abs(seconds() - 150.0 / 1e3) < 1e-9
        assert seconds() == seconds()  # read once; its events are recorded again since
        made.append(gpu.made)
    assert made[1] == made[2] == made[3], made  # no new event after the first step
    assert len(refreshed) == 4  # the compute stream looked up once per span
