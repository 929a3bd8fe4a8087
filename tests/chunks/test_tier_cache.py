"""The tier cache's non-blocking insert: which copy a prefetch may push out."""

from __future__ import annotations

import torch

from infinity.chunks.accounting import TierAccount
from infinity.chunks.cache import TierCache
from infinity.chunks.pools import SlabPool
from infinity.schedule.eviction import LRUPolicy

SLOT = 4096


def _cache(slots: int) -> TierCache:
    pool = SlabPool("host", SLOT, slots, lambda n: torch.empty(n, dtype=torch.uint8))
    return TierCache(
        "host", {SLOT: pool}, LRUPolicy(), TierAccount("host", None), lambda _copy: None
    )


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
