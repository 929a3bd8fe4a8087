"""The tier cache's eviction: which copy a prefetch may push out, and which one a
blocking insert gives up."""

from __future__ import annotations

import torch

from infinity.chunks.cache import TierCache
from infinity.chunks.pools import SlabPool, TierAccount
from infinity.schedule.trace import LRUPolicy

SLOT = 4096


def _cache(slots: int, write_back=lambda _copy: None) -> TierCache:
    pool = SlabPool("host", SLOT, slots, lambda n: torch.empty(n, dtype=torch.uint8))
    return TierCache("host", {SLOT: pool}, LRUPolicy(), TierAccount("host", None), write_back)


class _Transfer:
    """A transfer in flight until waited for."""

    def __init__(self) -> None:
        self.finished = False

    def wait(self) -> None:
        self.finished = True

    def done(self) -> bool:
        return self.finished


def test_a_protected_copy_does_not_block_evicting_another():
    cache = _cache(2)
    cache.insert("older", SLOT, moment=0)
    cache.insert("newer", SLOT, moment=1)
    # LRU would push out "older", but a queued update still needs it.
    copy = cache.try_insert("next", SLOT, 2, may_evict=lambda key: key != "older")
    assert copy is not None
    assert "older" in cache and "newer" not in cache and "next" in cache


def test_nothing_evictable_means_not_now():
    cache = _cache(2)
    cache.insert("a", SLOT, moment=0)
    cache.insert("b", SLOT, moment=1)
    assert cache.try_insert("c", SLOT, 2, may_evict=lambda key: False) is None
    assert "a" in cache and "b" in cache and "c" not in cache
    # With everything allowed, the least recently used one goes.
    assert cache.try_insert("c", SLOT, 3, may_evict=lambda key: True) is not None
    assert "a" not in cache and "b" in cache


def test_a_blocking_insert_waits_for_a_landing_copy_rather_than_write_back_a_dirty_one():
    # A device gradient chunk still receiving gradients (dirty) and a prefetched
    # parameter chunk still landing: giving up the gradient chunk would flush
    # it early and add its later gradients through host memory.
    written = []
    cache = _cache(2, write_back=lambda copy: written.append(copy.key))
    dirty = cache.insert("grad", SLOT, moment=0)
    dirty.dirty = True
    landing = cache.insert("prefetched", SLOT, moment=1)
    transfer = _Transfer()
    landing.pending.append(transfer)
    cache.insert("needed now", SLOT, moment=2)
    assert transfer.finished and written == []
    assert "grad" in cache and "prefetched" not in cache and "needed now" in cache
    # A clean copy goes before the dirty one even when it was used later.
    cache.insert("another", SLOT, moment=3)
    assert written == [] and "needed now" not in cache
    # With nothing clean left, the dirty copy is written back and goes.
    cache.get("another").pins += 1
    cache.insert("last", SLOT, moment=4)
    assert written == ["grad"] and "grad" not in cache


def _two_sizes(small: int, large: int) -> TierCache:
    """A device cache of two slot sizes that keeps chunks in slots of their own size
    (a plan with recomputed blocks: ``lend_larger=False``)."""

    def pool(size: int, count: int) -> SlabPool:
        return SlabPool("device", size, count, lambda n: torch.empty(n, dtype=torch.uint8))

    return TierCache(
        "device",
        {SLOT: pool(SLOT, small), 2 * SLOT: pool(2 * SLOT, large)},
        LRUPolicy(),
        TierAccount("device", None),
        lambda _copy: None,
        lend_larger=False,
    )


def test_a_demand_fetch_waits_for_a_slot_of_its_size_still_landing_before_a_larger_one():
    # Sharded, a flushed gradient chunk stays retired in its slot until its
    # reduce-scatter and copy home land; a small chunk of a recomputed block that
    # took a free large slot instead left a large chunk of the block none.
    cache = _two_sizes(small=1, large=1)
    flush = _Transfer()
    grad = cache.insert("grad", SLOT, moment=0)
    grad.pending.append(flush)
    cache.evict("grad")  # retired: the slot is freed once the flush lands
    small = cache.insert("small", SLOT, moment=1)
    assert flush.finished and small.slot.nbytes == SLOT
    small.pins += 1  # held by the recomputation, as the large chunk below
    assert cache.insert("large", 2 * SLOT, moment=2).slot.nbytes == 2 * SLOT


def test_a_prefetch_never_waits_for_a_slot_still_landing():
    cache = _two_sizes(small=1, large=1)
    flush = _Transfer()
    cache.insert("grad", SLOT, moment=0).pending.append(flush)
    cache.evict("grad")
    assert cache.try_insert("small", SLOT, 1, may_evict=lambda _key: True) is None
    assert not flush.finished
