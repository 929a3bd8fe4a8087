"""Per-step timing and traffic: the interval between two optimizer steps."""

from __future__ import annotations

import time

from infinity.chunks.accounting import Traffic


class StepTimer:
    """Splits each step interval into time waiting per tier and the rest (compute)."""

    def __init__(self, traffic: Traffic) -> None:
        self._traffic = traffic
        self._start = time.perf_counter()
        self._base = traffic.snapshot()
        self.last: dict[str, float] = {}

    def lap(self) -> dict[str, float]:
        """Close the current interval (called at the end of an optimizer step)."""
        now = time.perf_counter()
        current = self._traffic.snapshot()
        delta = {k: current[k] - self._base.get(k, 0.0) for k in current}
        seconds = now - self._start
        waiting = sum(v for k, v in delta.items() if k.startswith("wait_"))
        delta["seconds"] = seconds
        delta["compute_seconds"] = max(0.0, seconds - waiting)
        self.last = delta
        self._start, self._base = now, current
        return delta
