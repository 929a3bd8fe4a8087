"""Sharded chunks (data parallel): whole chunks built from every rank's shard.

With ``Plan.shard_count`` ranks, each rank's homes and staging hold one equal
shard of every chunk (elements ``Plan.home_window``); the device holds whole
chunks. Host side: state reads and writes by tensor (``state_dict``, checkpoints, gradients,
norms) open a *whole* host copy of a chunk (:func:`open_whole`): gathered for
reading, and written back by each rank taking its own shard out of it.

An optimizer unit's shard is laid out like the unit of a chunk of the shard's
size (master, then each state slot's values and int8 scales): exactly a span
of the whole unit (``chunks/pools.py``), whose byte ranges say where each
piece goes.

NOTE: a gather is collective: all ranks call it for the same chunks in the
same order (state reads), never because of a cache decision or an I/O
completion, which differ between ranks.

Device side: a parameter chunk is gathered into its device slot when it is needed:
each rank copies its shard to its place in the slot, then one in-place all-gather
fills the rest. The prefetcher starts gathers of the next needs in the trace
asynchronously.

Gathers are collective, so each is decided at a point every rank reaches
in the same order (a module hook, the prefetch after it) and from facts every
rank shares. What a rank has cached is not such a fact (prefetch timing shapes
eviction): the ranks agree on it in a small collective, except for the chunks
:class:`InUse` holds, which every rank is known to have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.chunks.cache import Copy, TierCache
from infinity.chunks.homes import DeviceHomeCopy
from infinity.chunks.pools import SpanKey, TierAccount, Traffic, part_ranges
from infinity.chunks.states import UpdateStates
from infinity.core.names import Key, Kind
from infinity.core.plan import IN_USE_CHUNKS, Plan
from infinity.devices.base import DeviceBackend
from infinity.distributed import Collectives


def shard_ranges(plan: Plan, key: Key, rank: int) -> list[tuple[int, int]]:
    """(byte offset in the whole chunk of ``key``, bytes) of each piece of ``rank``'s shard,
    in the order the shard's home lays them out."""
    kind, chunk = key[0], key[1]
    size = plan.home_elems(chunk)
    return part_ranges(plan, SpanKey(kind, chunk, rank * size, (rank + 1) * size))


def whole_bytes(plan: Plan, key: Key) -> int:
    """Bytes of ``key``'s whole chunk (every rank's shard)."""
    if key[0] is Kind.OPTIM:
        return plan.optim_bytes(key[1]) * plan.shard_count
    return plan.device_param_bytes(key[1])


def gather_whole(
    plan: Plan, collectives: Collectives, key: Key, shard: torch.Tensor, out: torch.Tensor
) -> None:
    """``out`` (uint8, :func:`whole_bytes`) = the whole chunk of ``key`` from every rank's
    ``shard`` (uint8, this rank's home bytes)."""
    count, nbytes = plan.shard_count, shard.numel()
    what = f"gathering {key[0].value} chunk {key[1]}"
    if key[0] is not Kind.OPTIM:
        out[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes].copy_(shard)
        collectives.all_gather_in_place(out, what)
        return
    # The shards of a unit arrive rank after rank; each is then cut into
    # its pieces (master, slot values, scales), which go to their parts' places.
    gathered = torch.empty(count * nbytes, dtype=torch.uint8)
    gathered[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes].copy_(shard)
    collectives.all_gather_in_place(gathered, what)
    for rank in range(count):
        at = rank * nbytes
        for offset, size in shard_ranges(plan, key, rank):
            out[offset : offset + size].copy_(gathered[at : at + size])
            at += size


def take_shard(plan: Plan, key: Key, whole: torch.Tensor, shard: torch.Tensor) -> None:
    """``shard`` (this rank's home bytes of ``key``) = its part of ``whole``."""
    at = 0
    for offset, size in shard_ranges(plan, key, plan.shard_rank):
        shard[at : at + size].copy_(whole[offset : offset + size])
        at += size


def place_shard(plan: Plan, key: Key, shard: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of ``whole`` = ``shard`` (the inverse of :func:`take_shard`)."""
    at = 0
    for offset, size in shard_ranges(plan, key, plan.shard_rank):
        whole[offset : offset + size].copy_(shard[at : at + size])
        at += size


def device_shard(plan: Plan, chunk: int, slot: torch.Tensor) -> torch.Tensor:
    """This rank's shard inside a whole device parameter or gradient slot (uint8)."""
    nbytes = plan.param_bytes(chunk)
    return slot[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes]


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

        The prefetch after a step promises the next forward's first chunks
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


class DeviceAccess(Protocol):
    """What :func:`gather_param`, :func:`start_gathers` and :func:`open_whole` use of the
    chunk manager."""

    plan: Plan
    transient_account: TierAccount
    collectives: Collectives
    device: TierCache
    backend: DeviceBackend
    traffic: Traffic
    moment: int
    updates: UpdateStates
    in_use: InUse

    def open_host(
        self, key: Key, *, load: bool = True, writable: bool = True, on_device: bool = False
    ) -> tuple[torch.Tensor, Copy | DeviceHomeCopy | None]: ...

    def close_host(
        self, copy: Copy | DeviceHomeCopy | None, *, modified: bool, keep: bool = False
    ) -> None: ...

    def prefetch_host(self, key: Key, protect: Collection[Key] = ()) -> bool: ...

    def sooner_than(self, key: Key) -> Callable[[Hashable], bool]: ...


def start_gathers(
    manager: DeviceAccess, chunks: list[int], host_ready: Callable[[Key], bool]
) -> None:
    """Start gathering, without blocking, the parameter chunks of ``chunks`` (the next
    needs in the trace, the same list on every rank) that some rank lacks.

    A chunk is gathered only if every rank can take part now: its update is not
    queued, its shard is in host memory, and a device slot is free without
    evicting anything needed sooner. The ranks agree on that in one collective;
    a rank that has the chunk cached gathers into its copy (the same bytes).
    Shards still on NVMe are read into host staging for a later call.
    ``host_ready`` says whether a key's bytes are in host memory now (the staging's).
    """
    collectives = manager.collectives
    plan, device = manager.plan, manager.device
    if chunks == manager.in_use.prefetched:
        # Agreed once per list, i.e. when the trace moves on to another
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
            unable.append(True)  # its home shard is stale until the update runs
            continue
        if cached:
            unable.append(False)
            continue
        if not host_ready(key):
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
            # A cached copy already holds these bytes: rewritten in place.
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


@dataclass
class WholeChunk:
    """A whole host copy of a chunk opened by :func:`open_whole` (sharded plans)."""

    key: Key
    region: torch.Tensor  # this rank's home bytes (a host home or staging copy)
    # the copy behind ``region``, if any (no device home is sharded, see
    # NOTE [chunks homed on the device])
    copy: Copy | DeviceHomeCopy | None
    whole: torch.Tensor  # the chunk's bytes, every shard


def open_whole(
    manager: DeviceAccess,
    key: Key,
    *,
    load: bool = True,
    writable: bool = True,
    gather: bool = True,
) -> tuple[torch.Tensor, WholeChunk | Copy | DeviceHomeCopy | None]:
    """``manager.open_host`` of the whole chunk (every rank's shard): collective when
    sharded, where ``load`` gathers it; pair with :func:`close_whole`.

    ``gather=False`` (not collective) loads only this rank's part of the whole
    chunk, the rest being zeros: enough for writes every rank makes alike, of
    which each keeps only its own shard (loading state it was given whole).
    """
    region, copy = manager.open_host(key, load=load, writable=writable)
    plan = manager.plan
    if not plan.sharded:
        return region, copy
    whole = torch.zeros(whole_bytes(plan, key), dtype=torch.uint8)
    account = manager.transient_account
    account.add(whole.nbytes)
    if load and gather:
        # A unit's shards arrive in a buffer of their own (gather_whole), as large
        gathered = whole.nbytes if key[0] is Kind.OPTIM else 0
        account.add(gathered)
        try:
            gather_whole(plan, manager.collectives, key, region, whole)
        finally:
            account.sub(gathered)
    elif load:
        place_shard(plan, key, region, whole)
    return whole, WholeChunk(key, region, copy, whole)


def close_whole(
    manager: DeviceAccess,
    handle: WholeChunk | Copy | DeviceHomeCopy | None,
    *,
    modified: bool,
    keep: bool = False,
) -> None:
    """Finish with :func:`open_whole` (``keep`` as ``close_host``); if ``modified`` each
    rank stores its own shard of the whole chunk (every rank must have written the
    same whole values)."""
    if not isinstance(handle, WholeChunk):
        manager.close_host(handle, modified=modified, keep=keep)
        return
    manager.transient_account.sub(handle.whole.nbytes)
    if modified:
        take_shard(manager.plan, handle.key, handle.whole, handle.region)
    manager.close_host(handle.copy, modified=modified, keep=keep)
