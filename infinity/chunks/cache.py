"""A tier's slots used as a cache of chunk copies, with safe eviction.

A copy may give up its slot only when nothing can still touch the memory:
no pin (in use by a module or the optimizer), no transfer in flight, and no
live view handed out (tracked through storage weak references of aliases)."""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from infinity.chunks.pools import Pending, PoolExhausted, SlabPool, Slot, TierAccount


class EvictionPolicy(Protocol):
    """Ranks eviction candidates; told of every access through :meth:`touch`.

    Declared here, where caches use it; the strategies live in
    :mod:`infinity.schedule.trace`. *Whether* a copy may go is the cache's
    rule, never the policy's. A policy may also define ``next_use(key, moment)
    -> float`` (moments until ``key`` is needed, as Belady's does): prefetching
    then evicts only copies needed later than what it fetches.
    """

    name: str

    def touch(self, key: Hashable, moment: int) -> None:
        """``key`` was accessed at ``moment`` (a position in the step's access sequence)."""

    def choose(self, candidates: Sequence[Hashable], moment: int) -> Hashable:
        """The candidate to evict now (``candidates`` is never empty)."""
        ...

    def forget(self, key: Hashable) -> None:
        """``key`` left the cache."""


@dataclass(eq=False)
class Copy:
    """One chunk copy resident in a tier cache."""

    key: Hashable
    slot: Slot
    nbytes: int = 0  # bytes of the chunk (the slot may be larger)
    fill: Pending | None = None  # the transfer that brings the data in (staging reads)
    # NOTE: a device copy is inserted before its bytes are sent (a gather first
    # agrees, then fills): until then its slot holds whatever it last held, so
    # nothing may read it as the chunk's bytes (``HostStaging`` copies from
    # landed device copies). Set once a transfer into the slot has started.
    filled: bool = False
    pending: list[Pending] = field(default_factory=list)
    dirty: bool = False  # must be written back before the slot is reused
    pins: int = 0
    aliases: list[StorageWeakRef] = field(default_factory=list)
    # The chunk's bytes in the slot (uint8): made once, hooks ask for it constantly.
    tensor: torch.Tensor = field(init=False, repr=False)
    _typed: dict[torch.dtype, torch.Tensor] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.tensor = self.slot.tensor[: self.nbytes] if self.nbytes else self.slot.tensor

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The chunk's bytes as a flat tensor of ``dtype`` (cached per dtype).

        NOTE: these views share the slab's storage, not an alias's, so caching
        them keeps no alias alive and never blocks eviction.
        """
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.tensor.view(dtype)
        return view

    def in_flight(self) -> bool:
        """Some transfer into or out of the slot has not completed.

        Finished transfers are reaped through ``wait()``, which raises if one
        failed: a failed read or write is never mistaken for a landed one.
        """
        if self.pending:  # the common case (nothing in flight) allocates nothing
            running = []
            for p in self.pending:
                if p.done():
                    p.wait()  # raises before anything is forgotten
                else:
                    running.append(p)
            self.pending = running
        return bool(self.pending)

    def wait(self) -> None:
        """Wait for every transfer on the slot, then raise the first error, if any.

        A transfer is forgotten only once it has succeeded: after an error the
        failed one stays, so every later wait raises again.
        """
        error: BaseException | None = None
        kept: list[Pending] = []
        for p in self.pending:
            try:
                p.wait()
            except Exception as exc:
                error = error or exc
                kept.append(p)
        self.pending = kept
        if error is not None:
            raise error

    def add_alias(self, alias: torch.Tensor) -> None:
        """Track a view handed out over this slot."""
        self.aliases.append(StorageWeakRef(alias.untyped_storage()))

    def has_live_views(self) -> bool:
        """Some tensor handed out over this slot is still alive."""
        self.aliases = [a for a in self.aliases if not a.expired()]
        return bool(self.aliases)

    def evictable(self) -> bool:
        """May give up its slot now."""
        return self.pins == 0 and not self.in_flight() and not self.has_live_views()


class TierCache:
    """Chunk copies in one tier's slab pools (one pool per slot size)."""

    def __init__(
        self,
        tier: str,
        pools: dict[int, SlabPool],
        policy: EvictionPolicy,
        account: TierAccount,
        write_back: Callable[[Copy], None],
        *,
        lend_larger: bool = True,
    ) -> None:
        """``write_back``: held weakly if it is a bound method (of the cache's owner,
        which holds the cache): NOTE [the model owns its engine]."""
        self.tier = tier
        # A chunk may take a free slot larger than its own (see _take_own_size).
        self.lend_larger = lend_larger
        self.pools = pools
        self.policy = policy
        self.account = account
        self._write_back: Callable[[], Callable[[Copy], None] | None] = (
            weakref.WeakMethod(write_back)
            if isinstance(write_back, types.MethodType)
            else lambda: write_back
        )
        self._copies: dict[Hashable, Copy] = {}
        self._by_ptr: dict[int, Hashable] = {}
        self._collected = False  # a gc pass was already tried for the current shortage
        self.version = 0  # changes whenever the set of resident keys changes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._copies

    def __iter__(self) -> Iterator[Copy]:
        return iter(list(self._copies.values()))

    def keys(self) -> list[Hashable]:
        """Keys of the resident copies (a snapshot)."""
        return list(self._copies)

    def key_at(self, data_ptr: int) -> Hashable | None:
        """The key whose copy starts at ``data_ptr`` (a slot's first byte), if any."""
        return self._by_ptr.get(data_ptr)

    def get(self, key: Hashable) -> Copy | None:
        """The resident copy of ``key``, if any."""
        return self._copies.get(key)

    def touch(self, key: Hashable, moment: int) -> None:
        """Tell the eviction policy ``key`` was used."""
        self.policy.touch(key, moment)

    def insert(self, key: Hashable, nbytes: int, moment: int) -> Copy:
        """A new copy of ``key`` in the smallest free slot of at least ``nbytes`` (a
        spare slot of the largest size then serves every size; without
        ``lend_larger``, one of its own size first: :meth:`_take_own_size`); if
        no slot is free, a copy in a large-enough slot is evicted.
        """
        if key in self._copies:
            raise AssertionError(f"{self.tier}: {key} is already resident")
        fitting = [pool for size, pool in sorted(self.pools.items()) if size >= nbytes]
        if not fitting:
            raise AssertionError(f"{self.tier}: no pool has slots of {nbytes} bytes")
        if self.lend_larger:
            slot = self._take(fitting)
        else:
            slot = self._take_own_size(fitting, moment, lambda _key: True, wait=True)
        while slot is None:
            self._evict_one(fitting, moment)
            slot = self._take(fitting)
        return self._place(key, slot, nbytes, moment)

    def try_insert(
        self, key: Hashable, nbytes: int, moment: int, may_evict: Callable[[Hashable], bool]
    ) -> Copy | None:
        """Like :meth:`insert` but never blocks: a free slot (of the chunk's own size
        unless larger ones are lent), or the eviction of the copy the policy picks
        among evictable ones with ``may_evict``; else ``None``.

        Prefetching uses it: it must not wait, nor push out a chunk needed sooner.
        """
        if key in self._copies:
            raise AssertionError(f"{self.tier}: {key} is already resident")
        fitting = [pool for size, pool in sorted(self.pools.items()) if size >= nbytes]
        if self.lend_larger:
            slot = self._take(fitting)
        else:
            # Nor does a prefetch borrow a larger slot: the chunk it brings is
            # used (and then held) later, when the chunks of that size may need it.
            fitting = fitting[:1]
            slot = self._take_own_size(fitting, moment, may_evict)
        if slot is None:
            # Filtered before the policy chooses: under Belady this is
            # the same as refusing when the farthest use is too near, and under
            # LRU it keeps a protected copy from blocking the eviction of others.
            candidates = [
                c.key
                for c in self._copies.values()
                if c.slot.pool in fitting and c.evictable() and may_evict(c.key)
            ]
            if not candidates:
                return None
            victim = self.policy.choose(candidates, moment)
            self.evict(victim)
            slot = self._take(fitting)
            if slot is None:
                return None  # the victim's write-back is still landing
        return self._place(key, slot, nbytes, moment)

    def _place(self, key: Hashable, slot: Slot, nbytes: int, moment: int) -> Copy:
        self._collected = False
        copy = Copy(key, slot, nbytes=nbytes)
        self._copies[key] = copy
        self._by_ptr[slot.tensor.data_ptr()] = key
        self.version += 1
        self.account.add(slot.nbytes)
        self.policy.touch(key, moment)
        return copy

    def _take_own_size(
        self,
        fitting: list[SlabPool],
        moment: int,
        may_evict: Callable[[Hashable], bool],
        *,
        wait: bool = False,
    ) -> Slot | None:
        """A free slot of the smallest fitting size, else one an idle clean copy of that
        size gives up (``may_evict``), else (``wait``) one a clean copy of that size
        gives up once its transfers land, else a free larger slot; ``None`` if none.

        NOTE: a chunk in a larger slot than its own takes that slot from the
        chunks of that size for as long as it is held. A checkpointed block holds
        every chunk of its recomputation until its backward: small chunks parked
        in the large slots then left a large one nowhere to go (PoolExhausted at
        budgets the plan counted per size), while idle copies sat in the small
        slots. Where no block is recomputed (``lend_larger``) holds are short and
        a spare large slot is better used as cache: fewer fetches
        (tests/engine/test_plan_estimate.py, 2.3x against 2x the parameter bytes).

        NOTE: a clean copy of the chunk's size still landing (a retired gradient
        flush, a prefetch) is that size's room too: a demand fetch waits for it
        rather than take a larger slot (a prefetch never blocks: ``wait=False``).
        Under data parallel a flush is a reduce-scatter started only when polled:
        a recomputed block's small chunks took the large slots its large chunks
        needed (PoolExhausted on 2 ranks, sweep seed 4242).
        """
        own = fitting[0]
        slot = own.try_take()
        if slot is not None:
            return slot
        while True:
            mine = [c for c in self._copies.values() if c.slot.pool is own]
            idle = [c.key for c in mine if c.evictable() and not c.dirty and may_evict(c.key)]
            if idle:
                self.evict(self.policy.choose(idle, moment))
                slot = own.try_take()
                if slot is not None:
                    return slot
            landing = [
                c
                for c in mine
                if c.pins == 0
                and not c.dirty
                and c.pending
                and not c.has_live_views()
                and may_evict(c.key)
            ]
            if not wait or not landing:
                return self._take(fitting[1:])
            # A retired copy gives up its slot and nothing else; a landing
            # prefetch would be fetched again.
            landing.sort(key=lambda c: not _retired(c.key))
            landing[0].wait()

    @staticmethod
    def _take(pools: list[SlabPool]) -> Slot | None:
        for pool in pools:
            slot = pool.try_take()
            if slot is not None:
                return slot
        return None

    def remove(self, key: Hashable) -> None:
        """Drop ``key``'s copy without writing it back (the caller made it safe)."""
        copy = self._copies[key]
        if copy.pins or copy.has_live_views():
            raise AssertionError(f"{self.tier}: {key} dropped while in use")
        if copy.dirty:
            raise AssertionError(f"{self.tier}: {key} dropped while dirty (its bytes are not home)")
        copy.wait()  # a failed transfer raises and the copy stays
        del self._copies[key]
        del self._by_ptr[copy.slot.tensor.data_ptr()]
        self.version += 1
        copy.slot.pool.give_back(copy.slot)
        self.account.sub(copy.slot.nbytes)
        self.policy.forget(key)

    def drop(self, copy: Copy) -> None:
        """:meth:`remove` ``copy`` itself: raise if it is no longer the resident copy
        of its key (it was evicted while someone held it, or dropped twice)."""
        if self._copies.get(copy.key) is not copy:
            raise AssertionError(
                f"{self.tier}: {copy.key} is no longer cached but was still held "
                "(a copy left the cache while in use)"
            )
        self.remove(copy.key)

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s copy (it is stale): free the slot now, or, while views of
        it are still alive somewhere, retire it until they die."""
        copy = self._copies[key]
        if copy.pins or copy.has_live_views() or copy.in_flight():
            self._retire(copy)
        else:
            self.remove(key)

    def evict(self, key: Hashable) -> None:
        """Write ``key`` back if dirty, then free its slot.

        A write-back may finish asynchronously: the copy then stays in its slot
        under a *retired* key (``key`` itself is free to be fetched again) and
        the slot is freed once the transfer has completed.
        """
        copy = self._copies[key]
        if copy.dirty:
            write_back = self._write_back()
            assert write_back is not None, "the cache outlived its owner"
            write_back(copy)
            copy.dirty = False
        if copy.in_flight():
            self._retire(copy)
        else:
            self.remove(key)

    def _retire(self, copy: Copy) -> None:
        del self._copies[copy.key]
        self.policy.forget(copy.key)
        copy.key = ("retired", copy.key, id(copy))
        self._copies[copy.key] = copy
        self._by_ptr[copy.slot.tensor.data_ptr()] = copy.key
        self.version += 1

    def _evict_one(self, pools: list[SlabPool], moment: int) -> None:
        mine = [c for c in self._copies.values() if c.slot.pool in pools]
        candidates = [c for c in mine if c.evictable()]
        busy = [c for c in mine if c.pins == 0 and not c.has_live_views() and c.pending]
        # NOTE: clean copies go before dirty ones, and a clean copy still
        # landing (a prefetch) is waited for rather than a dirty one written
        # back: a device gradient chunk still receiving gradients would be
        # flushed early and its later gradients added through host memory
        # and written again.
        clean = [c.key for c in candidates if not c.dirty]
        if clean:
            self.evict(self.policy.choose(clean, moment))
            return
        clean_busy = [c for c in busy if not c.dirty]
        if clean_busy:
            clean_busy[0].wait()
            return
        if candidates:
            self.evict(self.policy.choose([c.key for c in candidates], moment))
            return
        if busy:
            # Only transfers stand in the way: wait for one, then it is free to go.
            busy[0].wait()
            return
        if any(c.pins == 0 and c.aliases for c in mine) and not self._collected:
            # Views kept alive only by reference cycles die in a collection.
            self._collected = True
            gc.collect()
            return
        self._collected = False
        held = ", ".join(f"{c.key} (pins={c.pins}, live views={len(c.aliases)})" for c in mine)
        sizes = sorted({p.slot_bytes for p in pools})
        raise PoolExhausted(
            f"every {self.tier} slot of {sizes[0]} bytes or more is in use ({held}); "
            f"raise the {self.tier} budget or lower chunk_size."
        )


def _retired(key: Hashable) -> bool:
    """``key`` is a retired copy's (see :meth:`TierCache._retire`)."""
    return isinstance(key, tuple) and len(key) == 3 and key[0] == "retired"
