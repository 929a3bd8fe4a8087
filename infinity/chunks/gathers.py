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
from infinity.core.plan import IN_USE_CHUNKS
from infinity.devices.base import DeviceBackend


class InUse:
    """Parameter chunks every rank is known to hold on its device, pinned there.

    Two sets: the last chunks demanded, and the chunks a prefetch agreement
    gathered (or found on every rank), *promised* until their first demand. Both
    change only where every rank demands a chunk or agrees on a prefetch, and
    are emptied by the optimizer step (whose updates make the copies stale) and
    by a new iteration, so they are the same on every rank: a chunk they hold
    is demanded with no agreement. That covers a module's repeated uses of its
    chunk and, on track, the first use of every prefetched one.
    """

    def __init__(self, spare_slots: int) -> None:
        """``spare_slots``: device slots the plan leaves beyond its minimum; the last
        chunks demanded take up to :data:`IN_USE_CHUNKS` of them, promises the rest
        (pinned beyond them, copies could leave no room for what must come first)."""
        self.size = min(IN_USE_CHUNKS, spare_slots)
        self.promise_limit = spare_slots - self.size
        self._copies: OrderedDict[int, Copy] = OrderedDict()
        self._promised: dict[int, tuple[Copy, int]] = {}  # chunk -> (copy, iteration)
        self._iteration = 0
        # The prefetch list last agreed on (every rank's): see start_gathers.
        self.prefetched: list[int] = []

    def holds(self, chunk: int, copy: Copy) -> bool:
        """``copy`` is chunk ``chunk``'s device copy held here: a demand of it needs no
        agreement (it is then held as the latest demanded)."""
        promised = self._promised.pop(chunk, None)
        if promised is not None:
            promised[0].pins -= 1
            if promised[0] is copy:
                self.hold(chunk, copy)
                return True
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

    def promise(self, chunk: int, copy: Copy) -> None:
        """Every rank agreed it has ``copy`` (or is gathering it): pinned until demanded,
        room permitting."""
        if chunk not in self._promised and len(self._promised) < self.promise_limit:
            copy.pins += 1
            self._promised[chunk] = (copy, self._iteration)

    def next_iteration(self) -> None:
        """A forward starts: promises not demanded for a whole iteration are dropped
        (the model went another way than the trace; an evaluation loop never steps).

        NOTE: the prefetch after a step promises the next forward's first chunks
        in the iteration that ends: those are kept.
        """
        self._iteration += 1
        for chunk, (copy, made) in list(self._promised.items()):
            if made < self._iteration - 1:
                copy.pins -= 1
                del self._promised[chunk]

    def release(self) -> None:
        """Unpin every copy (the step makes them stale; a new iteration may go another way)."""
        for copy in [*self._copies.values(), *(c for c, _ in self._promised.values())]:
            copy.pins -= 1
        self._copies.clear()
        self._promised.clear()
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
    ready: list[Key] = []  # shards in host memory that this list will gather
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
            # NOTE: reading ahead must not evict a shard this list is about to
            # gather: it would be read again from disk, blocking, below.
            manager.prefetch_host(key, protect=ready)
            unable.append(True)
            continue
        ready.append(key)
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
        if agreed[n + k]:  # some rank cannot take part now
            if i in taken:
                device.remove(key)
            continue
        copy = device.get(key)
        assert copy is not None
        manager.in_use.promise(i, copy)
        if not agreed[k]:
            continue  # every rank has it already
        region, staged = manager.open_host(key, writable=False)
        try:
            # NOTE: a cached copy already holds these bytes: rewritten in place.
            device_shard(plan, i, copy.tensor).copy_(region)
        finally:
            manager.close_host(staged, modified=False, keep=True)
        copy.pending.append(
            collectives.start_all_gather(copy.tensor, f"gathering parameter chunk {i}")
        )
        copy.filled = True
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
    copy.filled = True
    manager.traffic.h2d_bytes += region.numel()
    manager.in_use.hold(i, copy)
    return copy
