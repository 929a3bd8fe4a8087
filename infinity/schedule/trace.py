"""The warm-up trace: the ordered chunk accesses of one training iteration.

The first iteration records every access (forward fetches, backward unpacks,
gradient arrivals) as a *moment*. The finished trace is immutable; later
iterations are compared against it as they run, and a divergence (the model
took another path) starts a new recording.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
