"""Eviction strategies against brute-force definitions."""

from __future__ import annotations

import random

from infinity.schedule.trace import BeladyPolicy, LRUPolicy


def test_lru_evicts_least_recently_touched():
    lru = LRUPolicy()
    for key in ["a", "b", "c", "a"]:
        lru.touch(key, 0)
    assert lru.choose(["a", "b", "c"], 0) == "b"


def _misses(policy_factory, sequence, capacity):
    policy = policy_factory()
    cache: set[int] = set()
    misses = 0
    for moment, key in enumerate(sequence):
        if key not in cache:
            misses += 1
            if len(cache) == capacity:
                cache.remove(policy.choose(sorted(cache), moment))
            cache.add(key)
        policy.touch(key, moment)
    return misses


def test_belady_is_never_worse_than_lru():
    rng = random.Random(1)
    for _ in range(30):
        seq = [rng.randrange(8) for _ in range(60)]
        uses: dict[int, list[int]] = {}
        for m, k in enumerate(seq):
            uses.setdefault(k, []).append(m)
        period = len(seq)
        belady = _misses(lambda u=uses, n=period: BeladyPolicy(u, n), seq, 3)
        lru = _misses(LRUPolicy, seq, 3)
        assert belady <= lru


def test_belady_picks_farthest_next_use():
    policy = BeladyPolicy({"a": [1, 9], "b": [2], "c": [5]}, period=10)
    assert policy.choose(["a", "b", "c"], 0) == "c"  # a at 1, b at 2, c at 5
    assert policy.next_use("b", 3) == 9  # wraps to the next iteration
