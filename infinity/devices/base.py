"""The small interface the chunk layer needs from a compute device, and the
device's clock of a step's compute and of its host-device link
(NOTE [the step's bound]).

Every backend has a clock (``DeviceBackend.clock``). The engine opens a span at a step's
first forward, brackets with :meth:`HostClock.stall` every place where its host
thread waits or works while the device may run dry (a wait for a transfer, a wait of
the compute stream on a copy, a host update, its hooks), and closes the span at
``optimizer.step()``: the device's compute is the span less the idle time inside
the brackets.

- :class:`HostClock` where compute shares the host's cores (the CPU, the fence): the
  host's clock, the brackets' wall time.
- :class:`EventClock` on a GPU: a bracket is two events on the compute stream. The
  GPU reaches the first when its queued work is done and the second when the host,
  done, records it: the time between them is exactly the time it idled for the engine
  (0 if it was still busy). Copies are timed by events on the copy stream, per
  direction. Events are read when the step's lap is first read, so the step itself
  never waits for them.

The hooks open a bracket around every call, about a thousand a step: on the
H200 the events were 8% of the host thread's time at a small batch (their creation,
and ``torch.cuda.current_stream`` at every record). A bracket's events go back to the
clock once their time is read and are recorded again, and the backend looks the
compute stream up once per span (``refresh``), not per event.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # NOTE: infinity.io loads the native module; `infinity plan` needs none
    from infinity.io import IORequest, SwapFile


class TransferHandle(abc.ABC):
    """One asynchronous copy. ``wait()`` blocks the host until it is complete."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the copy is complete; re-raise its error if it failed."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the copy is complete (never blocks)."""

    def wait_for_compute(self) -> None:
        """Make the data usable by compute kernels issued from now on.

        On CUDA this orders the compute stream after the copy without blocking
        the host; elsewhere it is :meth:`wait`.
        """
        self.wait()


class _Landed(TransferHandle):
    """A copy complete on the host's side (issued in compute order, or already done)."""

    def wait(self) -> None:
        """Nothing to wait for."""

    def done(self) -> bool:
        """Always complete."""
        return True


LANDED: TransferHandle = _Landed()


class DeviceBackend(abc.ABC):
    """Allocation and asynchronous copies for one compute device."""

    name: str
    device: torch.device
    # NOTE [host updates behind the forward]: True where compute runs apart from
    # the host's cores (a GPU), so host work done while it computes is free.
    computes_apart: bool = False
    # Whether device slots are host RAM to the operating system and to the budgets
    # (the CPU backend): then host and device bytes compete for the same RAM.
    shares_host_memory: bool = False

    @functools.cached_property
    def clock(self) -> HostClock:
        """The step's clock of its compute and link (NOTE [the step's bound]): the host's,
        unless a backend whose compute runs apart from the host sets its own (CUDA)."""
        return HostClock()

    @abc.abstractmethod
    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on the device, allocated once, 4 KiB aligned."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of exactly ``nbytes`` (rounded to 4 KiB), 4 KiB aligned,
        pinned where the device needs it for asynchronous copies."""

    @abc.abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        """Start ``dst.copy_(src)`` between host and device; returns its handle.

        The copy is ordered after compute already issued on the device (so a
        slot being overwritten is no longer read by earlier kernels).
        """

    def copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        """``dst.copy_(src)`` between two device regions (a chunk homed on the device and
        a slot), issued in the compute stream's order: compute issued later sees it, an
        earlier kernel still reading ``dst`` finishes first, and the host waits for nothing.
        """
        dst.copy_(src)
        return LANDED

    @abc.abstractmethod
    def alias(self, region: torch.Tensor) -> torch.Tensor:
        """A uint8 tensor over ``region``'s memory with a storage of its own.

        The engine hands out views of chunk slots only through aliases: when
        every alias of a slot is dead, no tensor anywhere can still read it, so
        the slot may be reused (this is checked with a storage weak reference).
        """

    def nvme_reader(self, swap_file: SwapFile) -> Callable[[torch.Tensor, int], IORequest] | None:
        """A reader of ``swap_file`` regions straight into device memory (GPU-direct
        storage), or ``None`` (the default): NVMe bytes reach the device through
        host staging. With one, parameters homed on NVMe take the route
        nvme -> device (NOTE [routes are data], docs/NOTES.md)."""
        return None

    def free_memory(self) -> int | None:
        """Bytes the device could still allocate now, or ``None`` if not known."""
        return None

    def synchronize(self) -> None:
        """Wait for all outstanding device work."""

    def close(self) -> None:
        """Release threads or streams owned by the backend."""


# Timed pairs kept before the finished ones are folded into sums: a model run
# forward only (no optimizer step closes its spans) keeps this many at most.
FOLD_AT = 1024


class HostClock:
    """The step clock of a device that computes on the host's cores."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._depth = 0
        self._stalled = 0.0
        self._mark: float | None = None  # when the outermost bracket opened in a span

    def open_span(self) -> None:
        """A step's device work starts (its first forward; later calls continue it)."""
        if self._start is None:
            self._start, self._stalled = time.perf_counter(), 0.0

    def stall(self) -> AbstractContextManager[None]:
        """Host work or a wait during which the device may idle for the engine: not
        counted as compute. Brackets nest; the outermost counts.

        The clock is its own bracket: the hooks open one around every call, a
        thousand a step (no generator, no allocation), and an object holding the
        clock would be a reference cycle (NOTE [the model owns its engine])."""
        return self

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def _enter(self) -> None:
        if self._depth == 0:
            self._mark = time.perf_counter() if self._start is not None else None
        self._depth += 1

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._mark is not None:
            self._stalled += time.perf_counter() - self._mark
            self._mark = None

    def close_span(self) -> Callable[[], float]:
        """The step ends: its device compute seconds, read later."""
        if self._start is None:
            return lambda: 0.0
        seconds = max(0.0, time.perf_counter() - self._start - self._stalled)
        self._start = None
        return lambda: seconds

    def copied(self, to_device: bool, start: object, end: object) -> None:
        """A copy was timed (only an event clock times copies)."""

    def take_link_seconds(self) -> Callable[[], tuple[float, float]] | None:
        """Seconds the link was busy (to the device, from it) since the last call, read
        later; ``None``: copies are not timed here (their bytes are counted at a
        measured memcpy rate instead)."""
        return None


class Event(Protocol):
    """What the clock uses of a timing event (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class EventClock(HostClock):
    """The step clock of a GPU: events on its compute and copy streams."""

    def __init__(
        self, record: Callable[[Event | None], Event], refresh: Callable[[], None] = lambda: None
    ) -> None:
        """``record(reuse)`` records a timing event on the compute stream: ``reuse`` (an
        event of this clock whose time was read) if given, else a new one; ``refresh()``
        looks the compute stream up again (at each span's start)."""
        super().__init__()
        self._record_event = record
        self._refresh = refresh
        self._free: list[Event] = []  # events whose time was read
        self._first: Event | None = None
        self._stalls: list[tuple[Event, Event]] = []
        self._stalled_ms = 0.0
        self._copies: list[tuple[bool, Event, Event]] = []
        self._copied_ms = [0.0, 0.0]
        self._opened: Event | None = None  # the outermost bracket's first event

    def _record(self) -> Event:
        try:
            reuse = self._free.pop()
        except IndexError:  # NOTE: not `if self._free`: a lap may be read on another thread
            reuse = None
        return self._record_event(reuse)

    def _read(self, pairs: list[tuple[Event, Event]]) -> float:
        """Milliseconds of finished ``pairs`` (all of them), whose events go back."""
        ms = 0.0
        for a, b in pairs:
            ms += a.elapsed_time(b)
            self._free += (a, b)
        return ms

    def open_span(self) -> None:
        if self._first is None:
            self._refresh()
            self._first = self._record()
            self._stalls, self._stalled_ms = [], 0.0

    def _enter(self) -> None:
        if self._depth == 0:
            self._opened = self._record() if self._first is not None else None
        self._depth += 1

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._opened is not None:
            self._stalls.append((self._opened, self._record()))
            self._opened = None
            if len(self._stalls) > FOLD_AT:
                self._stalled_ms += self._fold(self._stalls)

    def _fold(self, pairs: list[tuple[Event, Event]]) -> float:
        """Milliseconds of the finished pairs, which leave ``pairs``."""
        done = [i for i, (_, b) in enumerate(pairs) if b.query()]
        ms = self._read([pairs[i] for i in done])
        for i in reversed(done):
            del pairs[i]
        return ms

    def close_span(self) -> Callable[[], float]:
        first, stalls, stalled_ms = self._first, self._stalls, self._stalled_ms
        self._first, self._stalls, self._stalled_ms = None, [], 0.0
        if first is None:
            return lambda: 0.0
        end = self._record()
        result: list[float] = []

        def seconds() -> float:
            # NOTE: read once: the events go back to the clock, to be recorded again
            if not result:
                end.synchronize()
                idle = stalled_ms + self._read(stalls)
                result.append(max(0.0, self._read([(first, end)]) - idle) / 1e3)
            return result[0]

        return seconds

    def copied(self, to_device: bool, start: object, end: object) -> None:
        """A copy between ``start`` and ``end`` (events on the copy stream)."""
        self._copies.append((to_device, start, end))  # type: ignore[arg-type]
        if len(self._copies) > FOLD_AT:
            pending = []
            for way, a, b in self._copies:
                if b.query():
                    self._copied_ms[0 if way else 1] += a.elapsed_time(b)
                else:
                    pending.append((way, a, b))
            self._copies = pending

    def take_link_seconds(self) -> Callable[[], tuple[float, float]]:
        copies, folded = self._copies, self._copied_ms
        self._copies, self._copied_ms = [], [0.0, 0.0]

        def seconds() -> tuple[float, float]:
            ms = list(folded)
            for way, a, b in copies:
                b.synchronize()
                ms[0 if way else 1] += a.elapsed_time(b)
            return ms[0] / 1e3, ms[1] / 1e3

        return seconds
