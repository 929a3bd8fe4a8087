"""Open the NVMe swap file for a plan (or nothing when no state spills to NVMe)."""

from __future__ import annotations

from infinity.config import Config
from infinity.io import IOEngine, SwapFile


def open_swap(config: Config, nbytes: int) -> SwapFile | None:
    """A preallocated swap file of ``nbytes`` under ``config.nvme_path``, or ``None``."""
    if nbytes == 0 or config.nvme_path is None:
        return None
    engine = IOEngine(config.aio)
    return SwapFile(config.nvme_path, nbytes, engine, name="chunks")
