"""Routes and movers: how a chunk's bytes travel, as data, and the code that runs
each route a parameter chunk takes to the device.

Where each kind lives is the plan's (``Plan.param_home`` and friends); how its
bytes travel from there is the route table's. A route is a tuple of stops, e.g.
``nvme -> staging -> device``: the manager looks a route up and runs the mover
registered for it (:func:`device_mover`), which fills the device copy and
returns the transfer (``None``: a prefetch found no room now). A new way to
move bytes is one route and one mover here and, where it needs hardware, one
backend capability. See NOTE [routes are data] (docs/NOTES.md).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

import torch

from infinity.chunks.cache import Copy, TierCache
from infinity.chunks.homes import HomeStore, Reader
from infinity.chunks.pools import (
    AllOf,
    ChainedTransfer,
    Pending,
    SpanKey,
    Traffic,
    is_split,
    span_key,
    span_ranges,
    transfer_keys,
)
from infinity.chunks.staging import HostStaging
from infinity.core.names import DEVICE, HOST, NVME, Key, Kind, Tier, _Name
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend


class Stop(_Name):
    """A place bytes pass through: a home (host arena, swap file) or a cache slot."""

    NVME = "nvme"  # a home in the swap file
    HOST = "host"  # a home in a host arena
    STAGING = "staging"  # a pinned host staging slot
    DEVICE = "device"  # a device slot
    DEVICE_HOME = "device home"  # a home in the device arena (NOTE [chunks homed on the device])


class Purpose(_Name):
    """Why bytes move; each purpose is one kind's direction."""

    COMPUTE = "compute"  # parameters, home -> device, for forward and backward
    FLUSH = "flush"  # gradients, device -> home
    STEP = "step"  # any kind, home <-> host memory the optimizer runs on


@dataclass(frozen=True)
class Route:
    """The stops of one transfer, first (where the bytes are) to last."""

    stops: tuple[Stop, ...]

    def __post_init__(self) -> None:
        if len(self.stops) < 1 or len(set(self.stops)) != len(self.stops):
            raise ValueError(f"a route visits each stop once, got {self.stops}")

    @property
    def staged(self) -> bool:
        """The bytes pass through a host staging slot."""
        return Stop.STAGING in self.stops

    def __str__(self) -> str:
        if len(self.stops) == 1:
            return f"{self.stops[0]} (in place)"
        return " -> ".join(str(stop) for stop in self.stops)


def route(*stops: Stop) -> Route:
    """``Route`` of ``stops`` (shorter to write)."""
    return Route(tuple(stops))


# The routes every backend has: host homes are used in place by the optimizer
# and copied to or from the device; NVMe homes pass through host staging.
HOST_TO_DEVICE = route(Stop.HOST, Stop.DEVICE)
NVME_VIA_STAGING_TO_DEVICE = route(Stop.NVME, Stop.STAGING, Stop.DEVICE)
NVME_TO_DEVICE = route(Stop.NVME, Stop.DEVICE)
DEVICE_TO_HOST = route(Stop.DEVICE, Stop.HOST)
DEVICE_VIA_STAGING_TO_NVME = route(Stop.DEVICE, Stop.STAGING, Stop.NVME)
HOST_IN_PLACE = route(Stop.HOST)
NVME_TO_STAGING = route(Stop.NVME, Stop.STAGING)
DEVICE_HOME_TO_DEVICE = route(Stop.DEVICE_HOME, Stop.DEVICE)
DEVICE_TO_DEVICE_HOME = route(Stop.DEVICE, Stop.DEVICE_HOME)
DEVICE_HOME_IN_PLACE = route(Stop.DEVICE_HOME)


@dataclass(frozen=True)
class RouteTable:
    """The route of every (purpose, home tier)."""

    routes: Mapping[tuple[Purpose, Tier], Route]

    def __call__(self, purpose: Purpose, home: Tier | str) -> Route:
        """The route ``purpose``'s bytes take from (or to) a home on ``home``."""
        return self.routes[(purpose, Tier(home))]

    def lines(self) -> list[str]:
        """One line per route, for ``infinity plan`` and logs."""
        return [f"{p} from {t}: {r}" for (p, t), r in self.routes.items()]


def route_table(*, nvme_to_device: bool = False) -> RouteTable:
    """The routes for a backend; ``nvme_to_device``: it reads the swap file straight
    into device memory (GPU-direct storage), so parameters skip host staging.

    A sharded plan's parameters are gathered from every rank's shard
    (``chunks/shards.py``) whatever the table says: the gather is its route.
    """
    return RouteTable(
        {
            (Purpose.COMPUTE, HOST): HOST_TO_DEVICE,
            (Purpose.COMPUTE, NVME): NVME_TO_DEVICE
            if nvme_to_device
            else NVME_VIA_STAGING_TO_DEVICE,
            (Purpose.FLUSH, HOST): DEVICE_TO_HOST,
            (Purpose.FLUSH, NVME): DEVICE_VIA_STAGING_TO_NVME,
            (Purpose.STEP, HOST): HOST_IN_PLACE,
            (Purpose.STEP, NVME): NVME_TO_STAGING,
            (Purpose.COMPUTE, DEVICE): DEVICE_HOME_TO_DEVICE,
            (Purpose.FLUSH, DEVICE): DEVICE_TO_DEVICE_HOME,
            (Purpose.STEP, DEVICE): DEVICE_HOME_IN_PLACE,
        }
    )


class MoverAccess(Protocol):
    """What movers use of :class:`~infinity.chunks.manager.ChunkManager`
    (a protocol: the manager imports this module)."""

    plan: Plan
    backend: DeviceBackend
    homes: HomeStore
    host: HostStaging
    staging: dict[Kind, TierCache]
    traffic: Traffic
    nvme_reader: Reader | None


# A mover starts filling ``copy`` (a device slot of parameter chunk ``chunk``);
# with ``prefetch`` it never blocks, and returns None where it would have to.
Mover = Callable[[MoverAccess, int, Copy, bool], Pending | None]

# Spans of one device fill in flight at once: one landing from NVMe while the
# previous one is copied to the device.
FILL_WINDOW = 2


def from_host_home(manager: MoverAccess, chunk: int, copy: Copy, prefetch: bool) -> Pending:
    """host -> device: one copy from the chunk's host home."""
    return manager.backend.copy_async(copy.tensor, manager.homes.host((Kind.PARAM, chunk)))


def from_device_home(manager: MoverAccess, chunk: int, copy: Copy, prefetch: bool) -> Pending:
    """device home -> device slot: one copy in the compute stream's order."""
    return manager.backend.copy_on_device(copy.tensor, manager.homes.device((Kind.PARAM, chunk)))


def through_staging(manager: MoverAccess, chunk: int, copy: Copy, prefetch: bool) -> Pending | None:
    """nvme -> staging -> device: read into a staging slot, then copy (an oversize
    chunk span by span, a few staging slots at a time)."""
    if is_split(manager.plan, chunk):
        return SpanFill(manager, chunk, copy.tensor)
    return staged_copy(manager, (Kind.PARAM, chunk), copy.tensor, prefetch=prefetch)


def nvme_to_device(manager: MoverAccess, chunk: int, copy: Copy, prefetch: bool) -> Pending:
    """nvme -> device: the backend's reader puts the home's bytes in the device slot
    (an oversize chunk span by span, as its spans are written home).

    NOTE: a piece already in host staging (the optimizer just updated it
    there) is nearer than the disk, and may be newer than what has landed on
    it: it is copied from there. Pieces are the keys their writes used, so
    each read waits for the write of its own bytes still in flight.
    """
    assert manager.nvme_reader is not None
    size = manager.plan.element_size
    pieces = [
        (key, copy.tensor[start * size : end * size] if isinstance(key, SpanKey) else copy.tensor)
        for key, start, end in transfer_keys(manager.plan, Kind.PARAM, chunk)
    ]
    reads: list[Pending] = []
    for key, dst in pieces:
        if key in manager.staging[Kind.PARAM]:
            staged = staged_copy(manager, key, dst, prefetch=False)
            assert staged is not None  # cached: no slot to wait for
            manager.traffic.h2d_bytes += dst.numel()
            reads.append(staged)
        else:
            reads.append(manager.homes.read(key, dst, reader=manager.nvme_reader))
    return _WaitedByHost(reads[0] if len(reads) == 1 else AllOf(reads))


class _WaitedByHost:
    """A disk read into a device slot: compute waits for it on the host (the reader
    has no stream to order compute after)."""

    __slots__ = ("_read",)

    def __init__(self, read: Pending) -> None:
        self._read = read

    def done(self) -> bool:
        """The bytes have landed."""
        return self._read.done()

    def wait(self) -> None:
        """Block until they have; raises if the read failed."""
        self._read.wait()

    def wait_for_compute(self) -> None:
        """As :meth:`wait`."""
        self._read.wait()


_DEVICE_MOVERS: dict[Route, Mover] = {
    HOST_TO_DEVICE: from_host_home,
    NVME_VIA_STAGING_TO_DEVICE: through_staging,
    NVME_TO_DEVICE: nvme_to_device,
    DEVICE_HOME_TO_DEVICE: from_device_home,
}


def device_mover(route: Route) -> Mover:
    """The mover of a route to the device; a route no mover runs is a clear error."""
    mover = _DEVICE_MOVERS.get(route)
    if mover is None:
        known = ", ".join(str(r) for r in _DEVICE_MOVERS)
        raise AssertionError(f"no mover runs the route {route} (movers exist for {known})")
    return mover


def staged_copy(
    manager: MoverAccess, key: Key, dst: torch.Tensor, *, prefetch: bool
) -> Pending | None:
    """Read ``key`` (a parameter chunk or span) into host staging, then copy it to ``dst``
    on the device; None if ``prefetch`` found no staging slot."""
    staged = manager.host.staged(key, load=True, wait=False, prefetch=prefetch)
    if staged is None:
        return None
    src = staged.tensor
    # The backend, not the manager: the chain waits in the staging copy (a cycle).
    chain = ChainedTransfer(staged.fill, partial(manager.backend.copy_async, dst, src))
    staged.pending.append(chain)  # the staging slot is read until the copy ends
    return chain


class SpanFill:
    """Fill a device parameter slot of an NVMe-homed oversize chunk, span by span
    through host staging; advances whenever polled (``done``) or waited on."""

    def __init__(self, manager: MoverAccess, chunk: int, dst: torch.Tensor) -> None:
        # A proxy: the fill waits in the device copy the manager holds (a cycle).
        self._manager = cast(MoverAccess, weakref.proxy(manager))
        self._chunk = chunk
        self._dst = dst
        self._ranges = span_ranges(manager.plan, chunk)
        self._next = 0
        self._in_flight: deque[Pending] = deque()
        self._advance(block=False)

    def _start(self, block: bool) -> Pending | None:
        start, end = self._ranges[self._next]
        key = span_key(Kind.PARAM, self._chunk, start, end)
        size = self._manager.plan.element_size
        dst = self._dst[start * size : end * size]
        return staged_copy(self._manager, key, dst, prefetch=not block)

    def _advance(self, *, block: bool) -> None:
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft().wait()  # raises a failed read here
        while self._next < len(self._ranges) and len(self._in_flight) < FILL_WINDOW:
            pending = self._start(block)
            if pending is None:
                return
            self._in_flight.append(pending)
            self._next += 1

    def done(self) -> bool:
        """Every span has reached the device (starts the next spans that can start)."""
        self._advance(block=False)
        return self._next == len(self._ranges) and not self._in_flight

    def wait(self) -> None:
        """Bring every remaining span, waiting for staging slots and transfers."""
        while self._next < len(self._ranges) or self._in_flight:
            self._advance(block=True)
            if self._in_flight:
                self._in_flight.popleft().wait()

    def wait_for_compute(self) -> None:
        """Like :meth:`wait` (the spans' copies are waited for on the host)."""
        self.wait()
