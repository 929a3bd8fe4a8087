"""Host staging: the pinned host slots every NVMe transfer of a chunk passes through.

A component of :class:`~infinity.chunks.manager.ChunkManager`. It owns one
:class:`~infinity.chunks.cache.TierCache` per kind (the staging slots the plan
gives that kind) and the device -> host copies still landing in host homes
(gradient flushes), and answers "give me host bytes of this NVMe-homed key".
It knows nothing of gradients or updates: the manager checks those before
asking (see :meth:`~infinity.chunks.manager.ChunkManager.open_host`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from infinity.chunks.cache import Copy, EvictionPolicy, TierCache
from infinity.chunks.homes import HomeStore, Key, Kind
from infinity.chunks.pools import (
    Pending,
    SlabPool,
    SpanKey,
    TierAccount,
    Traffic,
    base_key,
    first_span,
    is_split,
)
from infinity.chunks.shards import device_shard
from infinity.chunks.states import Clock
from infinity.core.names import DEVICE, HOST
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.io import SwapFile

log = logging.getLogger("infinity")


def landed(fill: Pending | None) -> bool:
    """``fill`` (a transfer, or None for nothing in flight) has landed; raises if it failed."""
    if fill is None:
        return True
    if not fill.done():
        return False
    fill.wait()  # NOTE: done, so this only raises a failure instead of calling it landed
    return True


class HostStaging:
    """Host staging caches of NVMe-homed chunks, and host homes still being filled."""

    def __init__(
        self,
        plan: Plan,
        backend: DeviceBackend,
        homes: HomeStore,
        device: TierCache,
        account: TierAccount,
        traffic: Traffic,
        clock: Clock,
        policy: Callable[[], EvictionPolicy],
    ) -> None:
        """``device`` is read (never changed) to fill a parameter chunk from its
        device copy; ``policy()`` makes each kind's eviction policy."""
        self.plan = plan
        self.backend = backend
        self.homes = homes
        self.device = device
        self.traffic = traffic
        self.clock = clock
        self.caches: dict[Kind, TierCache] = {}
        for kind in Kind:
            pools = {
                size: SlabPool("host", size, count, backend.alloc_host)
                for size, count in plan.host_staging.get(kind.value, {}).items()
            }
            account.reserved += sum(p.reserved_bytes for p in pools.values())
            self.caches[kind] = TierCache(
                "host",
                pools,
                policy(),
                account,
                self._write_back_staging,
            )
        # Device -> host copies still landing in host homes (gradient flushes).
        self.home_fill: dict[Key, Pending] = {}

    def recut_units(self, plan: Plan) -> None:
        """Use ``plan`` (optimizer units cut for another optimizer): staged units, cut
        the old way, are dropped (the caller waited for every transfer: they are home)."""
        cache = self.caches[Kind.OPTIM]
        for key in cache.keys():
            cache.evict(key)
        self.plan = plan

    def register(self, swap_file: SwapFile | None) -> str | None:
        """Register the staging slabs (every NVMe transfer lands in one) with the
        I/O engine; ``None`` when done, else why not."""
        if swap_file is None:
            return "no NVMe tier"
        slabs = [pool.slab for cache in self.caches.values() for pool in cache.pools.values()]
        reason = swap_file.engine.register_buffers([s for s in slabs if s.numel()])
        if reason is not None:
            log.debug("staging buffers not registered with the kernel: %s", reason)
        return reason

    def staged(
        self,
        key: Key,
        *,
        load: bool,
        wait: bool = True,
        prefetch: bool = False,
        writable: bool = True,
        from_device: bool = False,
        protect: Collection[Key] = (),
        pin: bool = False,
    ) -> Copy | None:
        """A host staging copy of an NVMe-homed key, its read started if ``load``.

        ``wait`` blocks until the data has landed and, if ``writable``, until
        every transfer reading the buffer (write-backs, copies to the device)
        is done too, so it may be modified. ``prefetch`` never blocks for a
        slot: ``None`` if no slot can be had without waiting or without evicting
        one of the keys in ``protect``. ``from_device``
        lets a parameter chunk come from its landed device copy instead of the
        disk (not while fetching that very device copy, which is still empty).
        ``pin`` hands the caller a pin of the copy (a holder's reference, given
        back by ``ChunkManager.close_host``); without it the copy is held only
        by the transfers the caller appends to it.

        NOTE: the copy is pinned from the moment it is found or placed until it
        is handed over: nothing this call runs (an eviction, a wait) may take
        it from under the caller, and the caller of ``pin`` holds it from its
        first instant. Deciding where a parameter's bytes come from polls its
        device copy, whose transfers may advance a span fill that stages spans
        (``SpanFill``, ``chunks/movers.py``): that is done *before* a slot is
        taken, never while a copy nobody holds yet sits in it unfilled.
        """
        cache = self.caches[key[0]]
        copy = cache.get(key)
        moment = self.clock.now
        source: Copy | None = None
        if copy is None:
            if not isinstance(key, SpanKey) and is_split(self.plan, key[1]):
                raise AssertionError(f"{key} is oversize: stage it in spans (chunks/pools.py)")
            source = self._device_source(key) if load and from_device else None
            copy = cache.get(key)  # NOTE: the poll above may have staged it itself
        placed = copy is None
        if copy is None:
            nbytes = self.homes.nbytes(key)
            if prefetch:
                copy = cache.try_insert(key, nbytes, moment, lambda k: k not in protect)
                if copy is None:
                    return None
            else:
                copy = cache.insert(key, nbytes, moment)
        copy.pins += 1
        try:
            if placed and load:
                copy.fill = self._load(key, copy, source)
                copy.pending.append(copy.fill)
            self._settle(copy, key, wait=wait, writable=writable)
        except BaseException:
            copy.pins -= 1  # a failed read hands nothing over: no pin is left behind
            raise
        if not pin:
            copy.pins -= 1
        return copy

    def _settle(self, copy: Copy, key: Key, *, wait: bool, writable: bool) -> None:
        """Touch ``copy`` and, if ``wait``, wait for what :meth:`staged` promises."""
        self.caches[key[0]].touch(key, self.clock.now)
        if wait and writable and copy.pending:
            with self.traffic.waiting("nvme"):
                copy.wait()
        if wait and copy.fill is not None:
            # NOTE: reading needs only the incoming data; a write-back of the
            # same bytes still in flight does not stand in the way. Waited even
            # when done: that is what raises if the read failed.
            if copy.fill.done():
                copy.fill.wait()
            else:
                with self.traffic.waiting("nvme"):
                    copy.fill.wait()

    def _device_source(self, key: Key) -> Copy | None:
        """The landed device copy a parameter key's staging copy may be filled from
        (a device -> host copy instead of a disk read), if any."""
        if key[0] is not Kind.PARAM:
            return None
        on_device = self.device.get(base_key(key))
        if on_device is None or not on_device.filled or on_device.in_flight():
            return None
        return on_device

    def _load(self, key: Key, copy: Copy, on_device: Copy | None) -> Pending:
        """Start filling a staging copy: from ``on_device`` (see :meth:`_device_source`)
        if given, else from NVMe."""
        if on_device is None:
            return self.homes.read(key, copy.tensor)
        # Device parameter copies are exact caches of their home (an
        # update discards them), so these are the bytes the disk would give.
        source = on_device.tensor
        if self.plan.sharded:
            source = device_shard(self.plan, key[1], source)  # the device holds whole chunks
        elif isinstance(key, SpanKey):
            size = self.plan.element_size
            source = source[key.start * size : key.end * size]
        d2h = self.backend.copy_async(copy.tensor, source)
        on_device.pending.append(d2h)  # the device slot is read until the copy ends
        self.traffic.d2h_bytes += copy.nbytes
        return d2h

    def _write_back_staging(self, copy: Copy) -> None:
        """Evicting a staging copy that was never written home: write it now.

        Only gradient bytes an overlapped step was expected to consume
        are ever left dirty in staging (see ``GradientFlow``).
        """
        key = copy.key
        if not (isinstance(key, tuple) and key[0] is Kind.GRAD):
            raise AssertionError(f"staging copy {key} was left dirty")
        copy.pending.append(self.homes.write(key, copy.tensor))

    def wait_home(self, key: Key) -> None:
        """Wait for a device -> host copy still landing in a host home."""
        fill = self.home_fill.pop(key, None)
        if fill is not None:
            with self.traffic.waiting("device"):
                fill.wait()

    def host_ready(self, key: Key) -> bool:
        """``key``'s bytes are in host memory now (its home, or a landed staging read;
        for an oversize key, its first span)."""
        if self.homes.tier(key) == HOST:
            return landed(self.home_fill.get(key))
        if self.homes.tier(key) == DEVICE:
            return True  # stepped where it lives (NOTE [chunks homed on the device])
        key = first_span(self.plan, key)
        copy = self.caches[key[0]].get(key)
        return copy is not None and landed(copy.fill)
