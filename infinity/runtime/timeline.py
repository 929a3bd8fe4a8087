"""Memory timeline: bytes per tier and resident chunks at every moment of a step.

The engine samples it whenever it records an access; the last complete
iteration is kept for ``infinity.timeline(model)`` (and the ``infinity train``
plot), so a user tuning budgets can see where the peaks are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinity.core.names import Phase


@dataclass(frozen=True)
class Moment:
    """One access and the tiers right after it."""

    phase: Phase
    chunk: int
    device_bytes: int
    host_bytes: int
    device_chunks: tuple[int, ...]  # parameter chunks resident on the device
    device_grads: tuple[int, ...]  # gradient chunks on the device
    # Saved activations (activations="offload") in host memory and on NVMe.
    activation_host_bytes: int = 0
    activation_nvme_bytes: int = 0


@dataclass
class Timeline:
    """Moments of the running iteration; ``last`` holds the previous complete one."""

    current: list[Moment] = field(default_factory=list)
    last: list[Moment] = field(default_factory=list)

    def add(self, moment: Moment) -> None:
        """Append one sample to the running iteration."""
        self.current.append(moment)

    def finish_iteration(self) -> None:
        """The iteration ended: keep it as ``last`` (a forward-only pass, such as an
        evaluation, does not replace a training step)."""
        trained = any(m.phase != Phase.FORWARD for m in self.current)
        if self.current and (trained or not self.last):
            self.last = self.current
        self.current = []

    def as_dict(self) -> dict[str, list]:
        """Columns of the last complete iteration (or the running one if none)."""
        moments = self.last or self.current
        return {
            "phase": [m.phase.value for m in moments],
            "chunk": [m.chunk for m in moments],
            "device_bytes": [m.device_bytes for m in moments],
            "host_bytes": [m.host_bytes for m in moments],
            "device_chunks": [list(m.device_chunks) for m in moments],
            "device_grads": [list(m.device_grads) for m in moments],
            "activation_host_bytes": [m.activation_host_bytes for m in moments],
            "activation_nvme_bytes": [m.activation_nvme_bytes for m in moments],
        }
