"""Transfer routes as data: the places a chunk's bytes pass through, by purpose and home.

Where each kind lives is the plan's (``Plan.param_home`` and friends); how its
bytes travel from there is this table's. A route is a tuple of stops, e.g.
``nvme -> staging -> device``: the manager looks a route up and runs the mover
registered for it (``infinity/chunks/movers.py``), so a new way to move bytes
is one route here, one mover there and, where it needs hardware, one backend
capability. See NOTE [routes are data] (docs/NOTES.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infinity.core.names import HOST, NVME, Tier, _Name


class Stop(_Name):
    """A place bytes pass through: a home (host arena, swap file) or a cache slot."""

    NVME = "nvme"  # a home in the swap file
    HOST = "host"  # a home in a host arena
    STAGING = "staging"  # a pinned host staging slot
    DEVICE = "device"  # a device slot


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

    NOTE: a sharded plan's parameters are gathered from every rank's shard
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
        }
    )
