"""The prefetcher: which parameter chunks to start fetching, from the warm-up trace.

Pure policy: given the trace and the current position, it names the next
chunks the model will need that are not on the device yet, in order of need,
bounded by an in-flight limit (chunks), a byte budget and the device's slots.
The engine asks the chunk manager to fetch them without blocking and without
evicting anything needed sooner; a consumer later waits only on its own
chunk's handle.

NOTE [prefetch within the slots]: the plan walks the trace through the
device's slots, so that no prefetch is pushed out again before its use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from infinity.core.names import Phase
from infinity.schedule.trace import Trace

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
        # NOTE: the sizes are fixed for the trace's life, and plan() runs after every
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
        # NOTE: the walk depends on the position alone (what is resident only filters
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
        grad_slot = None  # NOTE: one gradient at a time: a finished one goes home
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
