"""Gathering sharded parameter chunks into the device (data parallel).

A parameter chunk is gathered into its device slot when it is needed: each
rank copies its shard to its place in the slot, then one in-place all-gather
fills the rest (``chunks/shards.py`` maps shards to whole chunks). The
prefetcher starts gathers of the next needs in the trace asynchronously.

NOTE: gathers are collective, so each is decided at a point every rank reaches
in the same order (a module hook, the prefetch after it) and from facts every
rank shares. What a rank has cached is not such a fact (prefetch timing shapes
eviction): the ranks agree on it in a small collective, except for the chunks
:class:`InUse` holds, which every rank is known to have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from typing import Protocol

from infinity.chunks.accounting import Traffic
from infinity.chunks.cache import Copy, TierCache
from infinity.chunks.shards import HostAccess, device_shard
from infinity.chunks.update_state import UpdateStates
from infinity.core.names import Key, Kind
from infinity.devices.base import DeviceBackend

IN_USE_CHUNKS = 2  # a module's parameters span at most two chunks (chunks/layout.py)


class InUse:
    """The last parameter chunks demanded, pinned on every rank's device.

    Changed only where every rank demands a chunk (and emptied by the optimizer
    step, whose updates make the copies stale), so its contents are the same on
    every rank: a chunk it holds is demanded again with no agreement. This is
    what a module's consecutive uses of one chunk, forward and backward, need.
    """

    def __init__(self, size: int = IN_USE_CHUNKS) -> None:
        self.size = size
        self._copies: OrderedDict[int, Copy] = OrderedDict()
        # The prefetch list last agreed on (every rank's): see start_gathers.
        self.prefetched: list[int] = []

    def holds(self, chunk: int, copy: Copy) -> bool:
        """``copy`` is chunk ``chunk``'s device copy held here (then it is kept longest)."""
        if self._copies.get(chunk) is not copy:
            return False
        self._copies.move_to_end(chunk)
        return True

    def hold(self, chunk: int, copy: Copy) -> None:
        """Hold ``copy`` (pinned), releasing the chunk held longest beyond ``size``."""
        old = self._copies.pop(chunk, None)
        if old is not None:
            old.pins -= 1
        copy.pins += 1
        self._copies[chunk] = copy
        while len(self._copies) > self.size:
            _chunk, released = self._copies.popitem(last=False)
            released.pins -= 1

    def release(self) -> None:
        """Unpin every held copy (the optimizer step makes them stale)."""
        for copy in self._copies.values():
            copy.pins -= 1
        self._copies.clear()
        self.prefetched = []


class DeviceAccess(HostAccess, Protocol):
    """What :func:`gather_param` and :func:`start_gathers` use of the chunk manager."""

    device: TierCache
    backend: DeviceBackend
    traffic: Traffic
    moment: int
    updates: UpdateStates
    in_use: InUse

    def host_ready(self, key: Key) -> bool: ...

    def prefetch_host(self, key: Key, protect: Collection[Key] = ()) -> bool: ...

    def sooner_than(self, key: Key) -> Callable[[Hashable], bool]: ...


def start_gathers(manager: DeviceAccess, chunks: list[int]) -> None:
    """Start gathering, without blocking, the parameter chunks of ``chunks`` (the next
    needs in the trace, the same list on every rank) that some rank lacks.

    A chunk is gathered only if every rank can take part now: its update is not
    queued, its shard is in host memory, and a device slot is free without
    evicting anything needed sooner. The ranks agree on that in one collective;
    a rank that has the chunk cached gathers into its copy (the same bytes).
    Shards still on NVMe are read into host staging for a later call.
    """
    collectives = manager.collectives
    assert collectives is not None
    plan, device = manager.plan, manager.device
    if chunks == manager.in_use.prefetched:
        # NOTE: agreed once per list, i.e. when the trace moves on to another
        # chunk, not after every module: meanwhile shards are only read ahead.
        for i in chunks:
            if (Kind.PARAM, i) not in device and not manager.updates.queued(i):
                manager.prefetch_host((Kind.PARAM, i))
        return
    manager.in_use.prefetched = list(chunks)
    missing, unable = [], []
    taken: dict[int, Copy] = {}
    for i in chunks:
        key = (Kind.PARAM, i)
        cached = key in device
        missing.append(not cached)
        if manager.updates.queued(i):
            unable.append(True)  # NOTE: its home shard is stale until the update runs
            continue
        if cached:
            unable.append(False)
            continue
        if not manager.host_ready(key):
            manager.prefetch_host(key)
            unable.append(True)
            continue
        copy = device.try_insert(
            key, plan.device_param_bytes(i), manager.moment, manager.sooner_than(key)
        )
        if copy is not None:
            taken[i] = copy
        unable.append(copy is None)
    agreed = collectives.any_each(missing + unable, "agreeing on parameter prefetches")
    n = len(chunks)
    for k, i in enumerate(chunks):
        key = (Kind.PARAM, i)
        if not agreed[k] or agreed[n + k]:
            if i in taken:
                device.remove(key)
            continue
        copy = device.get(key)
        assert copy is not None
        region, staged = manager.open_host(key, writable=False)
        try:
            # NOTE: a cached copy already holds these bytes: rewritten in place.
            device_shard(plan, i, copy.tensor).copy_(region)
        finally:
            manager.close_host(staged, modified=False, keep=True)
        copy.pending.append(
            collectives.start_all_gather(copy.tensor, f"gathering parameter chunk {i}")
        )
        manager.traffic.h2d_bytes += region.numel()


def gather_param(manager: DeviceAccess, i: int) -> Copy:
    """Parameter chunk ``i`` whole on the device, from every rank's shard.

    NOTE: whether a rank still has the chunk cached differs between ranks
    (prefetch timing shapes eviction), so the ranks first agree whether any
    of them needs it; then all take part in the gather.
    """
    key = (Kind.PARAM, i)
    collectives = manager.collectives
    assert collectives is not None
    copy = manager.device.get(key)
    if copy is not None and manager.in_use.holds(i, copy):
        return copy
    if not collectives.any(copy is None, f"fetching parameter chunk {i}"):
        assert copy is not None
        manager.in_use.hold(i, copy)
        return copy
    # NOTE: the shard is read before the device slot is taken: a staging read
    # may copy from a landed device copy, and a new one is still empty.
    region, staged = manager.open_host(key, writable=False)
    try:
        if copy is None:
            copy = manager.device.insert(key, manager.plan.device_param_bytes(i), manager.moment)
        else:
            copy.wait()
        own = device_shard(manager.plan, i, copy.tensor)
        with manager.traffic.waiting("device"):
            manager.backend.copy_async(own, region).wait()
    finally:
        manager.close_host(staged, modified=False, keep=True)
    collectives.all_gather_in_place(copy.tensor, f"gathering parameter chunk {i}")
    manager.traffic.h2d_bytes += region.numel()
    manager.in_use.hold(i, copy)
    return copy
