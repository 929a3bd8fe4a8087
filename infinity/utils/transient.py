"""Host buffers that live outside every budget for a while, counted per kind.

The memory report (``infinity.stats(model)["memory"]``) shows each kind beside the
host budget with its limit and the peak measured in this process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransientBuffers:
    """Bytes of one kind of transient buffer alive now, their peak and their limit."""

    name: str
    limit: int
    live: int = 0
    peak: int = 0

    def take(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` was allocated."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def give_back(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` was freed."""
        self.live -= nbytes

    def line(self) -> dict[str, int]:
        """The report's line: limit and peak."""
        return {"limit": self.limit, "peak": self.peak}


# The safetensors loader's one read buffer (pretrained/safetensors_io.py).
PRETRAINED_READS = TransientBuffers("pretrained read block", 16 << 20)
