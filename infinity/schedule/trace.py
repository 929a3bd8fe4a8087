"""The warm-up trace and the two policies it drives: eviction and prefetch.

The trace: the first iteration records every chunk access (forward fetches,
backward unpacks, gradient arrivals) as a *moment*. The finished trace is
immutable; later iterations are compared against it as they run, and a
divergence (the model took another path) starts a new recording.

Eviction (:class:`LRUPolicy`, :class:`BeladyPolicy`, :class:`TraceDrivenPolicy`):
which resident chunk copy gives up its slot. The cache asks only among copies
that may be evicted (not in use, not in flight, no live views); the policy just
ranks them. LRU needs no trace; Belady (OPT) uses the trace to evict the copy
whose next use is farthest away, which is optimal for a known access sequence.

Prefetch (:class:`Prefetcher`): pure policy. Given the trace and the current
position, it names the next chunks the model will need that are not on the
device yet, in order of need, bounded by an in-flight limit (chunks), a byte
budget and the device's slots. The engine asks the chunk manager to fetch them
without blocking and without evicting anything needed sooner; a consumer later
waits only on its own chunk's handle.

NOTE [prefetch within the slots]: the plan walks the trace through the
device's slots, so that no prefetch is pushed out again before its use.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from infinity.chunks.cache import EvictionPolicy
from infinity.core.names import Phase

log = logging.getLogger("infinity")

Access = tuple[Phase, int]  # (phase, chunk): forward, backward or grad


@dataclass(frozen=True)
class Trace:
    """The accesses of one iteration, in order."""

    accesses: tuple[Access, ...]

    def __len__(self) -> int:
        return len(self.accesses)


class TraceRecorder:
    """Records iterations; keeps the last complete one as :attr:`trace`."""

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self._current: list[Access] = []
        self.retraces = 0
        self.on_track = False  # the running iteration follows ``trace`` so far

    @property
    def moment(self) -> int:
        """Position of the next access in the running iteration."""
        return len(self._current)

    def start_iteration(self) -> None:
        """A new forward starts: close the running recording."""
        if self._current and self._keeps(self._current):
            if self.trace is None or not self.on_track or len(self._current) != len(self.trace):
                if self.trace is not None:
                    self.retraces += 1
                    if self.retraces == 1:
                        log.info(
                            "infinity: the model took a different path than the warm-up "
                            "trace; re-tracing (prefetch resumes on the next iteration)"
                        )
                self.trace = Trace(tuple(self._current))
        self._current = []
        self.on_track = self.trace is not None

    def _keeps(self, accesses: list[Access]) -> bool:
        """A forward-only pass (evaluation) does not replace a training trace."""
        if self.trace is None:
            return True
        trains = any(phase != Phase.FORWARD for phase, _ in self.trace.accesses)
        return not trains or any(phase != Phase.FORWARD for phase, _ in accesses)

    def record(self, phase: Phase, chunk: int) -> None:
        """Append one access; notice when the iteration leaves the trace."""
        access = (phase, chunk)
        if self.on_track:
            position = len(self._current)
            assert self.trace is not None
            if position >= len(self.trace) or self.trace.accesses[position] != access:
                self.on_track = False
        self._current.append(access)

    def end_backward(self) -> None:
        """Backward finished (the iteration may still run the optimizer)."""


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


NEED_PHASES = (Phase.FORWARD, Phase.BACKWARD)


class _Slots:
    """The device's free slots in a walk ahead: sizes and counts, smallest fit first
    (``None``: slots are not looked at, every take succeeds)."""

    def __init__(self, slots: Mapping[int, int] | None) -> None:
        self._free = Counter(slots) if slots else None

    def take(self, nbytes: int) -> int | None:
        """Take the smallest free slot of at least ``nbytes``; its size, or None."""
        if self._free is None:
            return nbytes
        for size in sorted(self._free):
            if size >= nbytes and self._free[size] > 0:
                self._free[size] -= 1
                return size
        return None

    def give_back(self, size: int) -> None:
        if self._free is not None:
            self._free[size] += 1


class Prefetcher:
    """Looks ahead in one iteration's trace for parameter-chunk needs."""

    def __init__(
        self,
        trace: Trace,
        depth: int,
        budget_bytes: int,
        nbytes: Callable[[int], int],
        *,
        slots: Mapping[int, int] | None = None,
        grad_bytes: Callable[[int], int] | None = None,
    ):
        """``slots``: the device's slot sizes and counts; with ``grad_bytes`` (a
        chunk's gradient bytes on the device, 0 when it has none) the plan keeps
        to them (NOTE [prefetch within the slots]); without, it does not look."""
        self.depth = depth
        self.budget_bytes = budget_bytes
        self._slots = dict(slots) if slots else None
        self._accesses = trace.accesses
        # The sizes are fixed for the trace's life, and plan() runs after every
        # access, walking tens of accesses: looked up once here, not called each time.
        chunks = {chunk for _, chunk in trace.accesses}
        self._sizes = {chunk: nbytes(chunk) for chunk in chunks}
        grads = grad_bytes or (lambda _chunk: 0)
        self._grads = {chunk: grads(chunk) for chunk in chunks}
        self._nbytes = self._sizes.__getitem__
        self._grad_bytes = self._grads.__getitem__
        # The trace with repeats of one access merged (a chunk's modules run one after
        # another: the walk skipped each repeat in turn), and each position's run.
        self._runs: list[tuple[Phase, int]] = []
        self._run_of: list[int] = []
        self._walks: dict[int, list[int]] = {}  # by the run a walk starts at
        for access in trace.accesses:
            if not self._runs or self._runs[-1] != access:
                self._runs.append(access)
            self._run_of.append(len(self._runs) - 1)

    def plan(self, position: int, on_device: Callable[[int], bool]) -> list[int]:
        """Chunks to fetch after ``position``: the first needs not already on the
        device, counting in-flight/resident upcoming chunks against the limits."""
        runs = self._runs
        if position < 0:
            start = 0
        elif position < len(self._run_of):
            start = self._run_of[position] + 1
        else:
            start = len(runs)
        # The walk depends on the position alone (what is resident only filters
        # its result), and plan() runs after every access: each walk is made once.
        walk = self._walks.get(start)
        if walk is None:
            walk = self._walks[start] = self._walk(position, start)
        return [chunk for chunk in walk if not on_device(chunk)]

    def _walk(self, position: int, start: int) -> list[int]:
        """The chunks the plan after ``position`` counts, in order of need, resident or not
        (``start``: the run after ``position``'s)."""
        free = _Slots(self._slots)
        seen: set[int] = set()
        grads: set[int] = set()
        grad_slot = None  # one gradient at a time: a finished one goes home
        if 0 <= position < len(self._accesses):
            phase, current = self._accesses[position]
            free.take(self._nbytes(current))  # the chunk in use
            seen.add(current)
            if phase != Phase.FORWARD and self._grad_bytes(current):
                grad_slot = free.take(self._grad_bytes(current))
                grads.add(current)
        walk: list[int] = []
        spent = 0
        runs = self._runs
        for k in range(start, len(runs)):
            phase, chunk = runs[k]
            if phase == Phase.GRAD:
                need = self._grad_bytes(chunk)
                if chunk not in grads and need > (grad_slot or 0):
                    if grad_slot is not None:
                        free.give_back(grad_slot)
                    grad_slot = free.take(need)
                grads.add(chunk)
                continue
            if phase not in NEED_PHASES or chunk in seen:
                continue
            seen.add(chunk)
            if len(walk) >= self.depth:
                break
            size = self._nbytes(chunk)
            if spent + size > self.budget_bytes and walk:
                break
            if free.take(size) is None and walk:
                break  # it would be pushed out again before its use
            spent += size
            walk.append(chunk)
        return walk
