"""Eviction strategies: which resident chunk copy gives up its slot.

The cache asks only among copies that may be evicted (not in use, not in
flight, no live views); the strategy just ranks them. LRU needs no trace;
Belady (OPT) uses the warm-up trace to evict the copy whose next use is
farthest away, which is optimal for a known access sequence.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping, Sequence

from infinity.chunks.cache import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evict the copy used least recently."""

    name = "lru"

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}
        self._clock = 0

    def touch(self, key: Hashable, moment: int) -> None:
        # NOTE: a private clock, not ``moment``: moments restart every step,
        # recency must not.
        self._clock += 1
        self._last[key] = self._clock

    def choose(self, candidates: Sequence[Hashable], moment: int) -> Hashable:
        return min(candidates, key=lambda k: self._last.get(k, -1))

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)


class BeladyPolicy(EvictionPolicy):
    """Evict the copy whose next use in the trace is farthest (never used again first).

    ``uses`` maps a key to the sorted moments at which the trace accesses it;
    ``period`` is the trace length, so a use before ``moment`` counts as
    happening again in the next step.
    """

    name = "belady"

    def __init__(self, uses: Mapping[Hashable, Sequence[int]], period: int) -> None:
        self._uses = {k: sorted(v) for k, v in uses.items()}
        self._period = max(1, period)
        self._fallback = LRUPolicy()

    def next_use(self, key: Hashable, moment: int) -> float:
        """Moments until ``key`` is used again (``inf`` if never)."""
        uses = self._uses.get(key)
        if not uses:
            return float("inf")
        i = bisect.bisect_right(uses, moment)
        if i < len(uses):
            return uses[i] - moment
        return uses[0] + self._period - moment

    def touch(self, key: Hashable, moment: int) -> None:
        self._fallback.touch(key, moment)

    def choose(self, candidates: Sequence[Hashable], moment: int) -> Hashable:
        # Ties (e.g. several never-used-again copies) fall back to LRU order.
        farthest = max(self.next_use(k, moment) for k in candidates)
        tied = [k for k in candidates if self.next_use(k, moment) == farthest]
        return tied[0] if len(tied) == 1 else self._fallback.choose(tied, moment)

    def forget(self, key: Hashable) -> None:
        self._fallback.forget(key)


class TraceDrivenPolicy(EvictionPolicy):
    """Belady while the running iteration follows the trace, LRU otherwise.

    ``active`` is switched by the engine as it compares each access with the
    trace; a model that changed its path must not be judged by a stale plan.
    """

    name = "trace"

    def __init__(self) -> None:
        self._lru = LRUPolicy()
        self._belady: BeladyPolicy | None = None
        self.active = False

    def set_trace(self, uses: Mapping[Hashable, Sequence[int]], period: int) -> None:
        """Use a new trace's access moments."""
        self._belady = BeladyPolicy(uses, period)

    def _on(self) -> bool:
        return self.active and self._belady is not None

    def touch(self, key: Hashable, moment: int) -> None:
        self._lru.touch(key, moment)
        if self._belady is not None:
            self._belady.touch(key, moment)

    def choose(self, candidates: Sequence[Hashable], moment: int) -> Hashable:
        if self._on():
            assert self._belady is not None
            return self._belady.choose(candidates, moment)
        return self._lru.choose(candidates, moment)

    def next_use(self, key: Hashable, moment: int) -> float:
        """Moments until ``key`` is needed (Belady's estimate; 0 without a trace)."""
        if self._on():
            assert self._belady is not None
            return self._belady.next_use(key, moment)
        return 0.0

    def forget(self, key: Hashable) -> None:
        self._lru.forget(key)
