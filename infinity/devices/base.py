"""The small interface the chunk layer needs from a compute device."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infinity.devices.step_clock import HostClock

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

    @functools.cached_property
    def clock(self) -> HostClock:
        """The step's clock of its compute and link (NOTE [the step's bound]): the host's,
        unless a backend whose compute runs apart from the host sets its own (CUDA)."""
        return HostClock()

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

    def synchronize(self) -> None:
        """Wait for all outstanding device work."""

    def close(self) -> None:
        """Release threads or streams owned by the backend."""
