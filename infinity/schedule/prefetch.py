"""The prefetcher: which parameter chunks to start fetching, from the warm-up trace.

Pure policy: given the trace and the current position, it names the next
chunks the model will need that are not on the device yet, in order of need,
bounded by an in-flight limit (chunks) and a byte budget. The engine asks the
chunk manager to fetch them without blocking and without evicting anything
needed sooner; a consumer later waits only on its own chunk's handle.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from infinity.core.names import Phase
from infinity.schedule.trace import Trace

NEED_PHASES = (Phase.FORWARD, Phase.BACKWARD)


class Prefetcher:
    """Looks ahead in one iteration's trace for parameter-chunk needs."""

    def __init__(self, trace: Trace, depth: int, budget_bytes: int, nbytes: Callable[[int], int]):
        self.depth = depth
        self.budget_bytes = budget_bytes
        self._nbytes = nbytes
        self._needs = [
            (position, chunk)
            for position, (phase, chunk) in enumerate(trace.accesses)
            if phase in NEED_PHASES
        ]
        self._positions = [p for p, _ in self._needs]

    def plan(self, position: int, on_device: Callable[[int], bool]) -> list[int]:
        """Chunks to fetch after ``position``: the first needs not already on the
        device, counting in-flight/resident upcoming chunks against the limits."""
        start = bisect.bisect_right(self._positions, position)
        chosen: list[int] = []
        seen: set[int] = set()
        ahead = 0
        spent = 0
        for _, chunk in itertools.islice(self._needs, start, None):
            if chunk in seen:
                continue
            seen.add(chunk)
            if ahead >= self.depth:
                break
            size = self._nbytes(chunk)
            if spent + size > self.budget_bytes and ahead:
                break
            ahead += 1
            spent += size
            if not on_device(chunk):
                chosen.append(chunk)
        return chosen
