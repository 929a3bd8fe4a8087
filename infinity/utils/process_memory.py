"""The process's memory as the operating system and the device allocator count it: the
resident set and its peak, the device allocator's peak, and giving freed blocks back.

What a step's forecast starts from (:func:`baseline_resident_set`) and what the memory
report measures against it (``runtime/memory.py``). Host buffers that live outside
every budget for a while are counted per kind (:class:`TransientBuffers`): the
memory report (``infinity.stats(model)["memory"]``) shows each kind beside the host
budget with its limit and the peak measured in this process.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import psutil
import torch


def resident_bytes() -> int:
    """This process's resident set now."""
    return int(psutil.Process().memory_info().rss)


def baseline_resident_set() -> int:
    """The resident set a step's forecast starts from, measured before the engine
    allocates: the interpreter, the libraries, the model as built, and what offloading
    itself imports and runs (the registry's fake forward: ``forward_order``).

    NOTE: torch._dynamo is imported first: the hooks' ``torch.compiler.disable``
    imports it when they are made (~80 MiB: dynamo, sympy, mpmath), and it stays."""
    import torch._dynamo  # noqa: F401

    return resident_bytes()


def resident_peak_bytes() -> int:
    """This process's peak resident set (``VmHWM``: since it started, or since a tool
    reset it through ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# glibc's mallopt parameter, and the size from which its allocations are mappings of their
# own (given back to the system when freed).
_M_MMAP_THRESHOLD = -3
RETURNED_FROM_BYTES = 1 << 20


def return_freed_memory() -> bool:
    """Make glibc give freed blocks of 1 MiB and more back to the system at once
    (NOTE [freed memory returns]); ``False`` where it is not glibc or the environment
    sets the threshold already."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, RETURNED_FROM_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False


def reset_resident_peak() -> bool:
    """Start the resident set's peak (``VmHWM``) over, so that it measures what follows
    (the training steps, not loading or set-up); ``False`` where the kernel offers no way."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def device_peak_bytes(device: torch.device) -> int | None:
    """The device allocator's peak bytes (CUDA, the fence); ``None`` where the device is
    host memory without an allocator of its own (the CPU)."""
    if device.type == "cpu":
        return None
    return int(torch.get_device_module(device.type).max_memory_allocated(device))


# CUDA's caching allocator rounds every block up to 512 bytes, and the fence's
# (cpp/fence/memory.cpp) counts as it does, so that a forecast that sums a tensor's
# own bytes where the allocator holds a block fails on the CPU too.
DEVICE_BLOCK_BYTES = 512


def device_block_bytes(device: torch.device) -> int:
    """The rounding of ``device``'s allocator: every allocation holds a multiple of it
    (1 on the CPU, whose device is host memory)."""
    return 1 if device.type == "cpu" else DEVICE_BLOCK_BYTES


def device_bytes(nbytes: int, device: torch.device) -> int:
    """What an allocation of ``nbytes`` holds on ``device`` (0 for none)."""
    block = device_block_bytes(device)
    return -(-nbytes // block) * block


def reset_device_peak(device: torch.device) -> None:
    """Start the device allocator's peak over (nothing on the CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).reset_peak_memory_stats(device)


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
