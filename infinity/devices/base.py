"""The small interface the chunk layer needs from a compute device."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # NOTE: infinity.io loads the native module; `infinity plan` needs none
    from infinity.io import IORequest, SwapFile


class TransferHandle(abc.ABC):
    """One asynchronous copy. ``wait()`` blocks the host until it is complete."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the copy is complete; re-raise its error if it failed."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the copy is complete (never blocks)."""

    def wait_for_compute(self) -> None:
        """Make the data usable by compute kernels issued from now on.

        On CUDA this orders the compute stream after the copy without blocking
        the host; elsewhere it is :meth:`wait`.
        """
        self.wait()


class DeviceBackend(abc.ABC):
    """Allocation and asynchronous copies for one compute device."""

    name: str
    device: torch.device
    # NOTE [host updates behind the forward]: True where compute runs apart from
    # the host's cores (a GPU), so host work done while it computes is free.
    computes_apart: bool = False
    # Whether device slots are host RAM to the operating system and to the budgets
    # (the CPU backend): then host and device bytes compete for the same RAM.
    shares_host_memory: bool = False

    @abc.abstractmethod
    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on the device, allocated once, 4 KiB aligned."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of exactly ``nbytes`` (rounded to 4 KiB), 4 KiB aligned,
        pinned where the device needs it for asynchronous copies."""

    @abc.abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        """Start ``dst.copy_(src)`` between host and device; returns its handle.

        The copy is ordered after compute already issued on the device (so a
        slot being overwritten is no longer read by earlier kernels).
        """

    @abc.abstractmethod
    def alias(self, region: torch.Tensor) -> torch.Tensor:
        """A uint8 tensor over ``region``'s memory with a storage of its own.

        The engine hands out views of chunk slots only through aliases: when
        every alias of a slot is dead, no tensor anywhere can still read it, so
        the slot may be reused (this is checked with a storage weak reference).
        """

    def nvme_reader(self, swap_file: SwapFile) -> Callable[[torch.Tensor, int], IORequest] | None:
        """A reader of ``swap_file`` regions straight into device memory (GPU-direct
        storage), or ``None`` (the default): NVMe bytes reach the device through
        host staging. With one, parameters homed on NVMe take the route
        nvme -> device (NOTE [routes are data], docs/NOTES.md)."""
        return None

    def free_memory(self) -> int | None:
        """Bytes the device could still allocate now, or ``None`` if not known."""
        return None

    # --- the step's bound (NOTE [the step's bound], runtime/step_timer.py) --------------
    # Where compute shares the host's cores (the CPU, the fence), the device's
    # clock is the host's: the span's wall time less the brackets in it. A GPU
    # times its own stream instead (devices/cuda.py).
    _span_start: float | None = None
    _stall_depth = 0
    _stalled = 0.0

    def open_span(self) -> None:
        """A step's device work starts (its first forward): the device's clock starts
        counting its compute."""
        if self._span_start is None:
            self._span_start, self._stalled = time.perf_counter(), 0.0

    @contextmanager
    def stall(self) -> Iterator[None]:
        """Bracket host work or a wait during which the device may idle for the engine
        (a wait for a transfer, a host update), so that time is not counted as
        compute. Brackets nest; the outermost counts."""
        outermost = self._span_start is not None and self._stall_depth == 0
        start = time.perf_counter()
        self._stall_depth += 1
        try:
            yield
        finally:
            self._stall_depth -= 1
            if outermost:
                self._stalled += time.perf_counter() - start

    def close_span(self) -> Callable[[], float]:
        """The step ends: its device compute seconds, read later (a device's events
        may still be pending when the host gets here)."""
        if self._span_start is None:
            return lambda: 0.0
        seconds = max(0.0, time.perf_counter() - self._span_start - self._stalled)
        self._span_start = None
        return lambda: seconds

    def take_link_seconds(self) -> Callable[[], tuple[float, float]] | None:
        """Seconds the host-device link was busy copying (to the device, from it) since
        the last call, read later; ``None`` where copies are not timed on the device
        (the step timer then counts their bytes at a measured memcpy rate)."""
        return None

    def synchronize(self) -> None:
        """Wait for all outstanding device work."""

    def close(self) -> None:
        """Release threads or streams owned by the backend."""
