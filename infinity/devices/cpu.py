"""CPU backend: the "device" tier is a budgeted pool in RAM, copies run on a thread.

NOTE: copies are deliberately asynchronous even though a memcpy would do: the
engine then has the same races as on a GPU, and tests catch a missing wait.
``copy_delay_s`` widens that window for tests. The copies run in submission
order on one native thread (``infinity._C.devices.CopyQueue``), like a CUDA
copy stream, not a Python one: see NOTE [GIL and native threads] (docs/NOTES.md).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from infinity._C import devices as _native
from infinity.devices.base import DeviceBackend, TransferHandle
from infinity.io import IORequest, SwapFile, aligned_empty


class _CopyHandle(TransferHandle):
    __slots__ = ("_backend", "_dst", "_job", "_src")

    def __init__(self, job: Any, dst: torch.Tensor, src: torch.Tensor, backend: CpuBackend) -> None:
        self._job = job
        self._backend = backend  # its clock: a wait is time the "device" idles
        # The native thread holds raw addresses: these references keep both
        # buffers alive until the handle is dropped (once done).
        # See NOTE [raw pointers into native code] (docs/NOTES.md).
        self._dst, self._src = dst, src

    def wait(self) -> None:
        with self._backend.clock.stall():
            self._job.wait()

    def done(self) -> bool:
        return self._job.done()


def _check_copy(dst: torch.Tensor, src: torch.Tensor, device_type: str) -> int:
    """Bytes of a copy between two contiguous tensors of equal size in host memory
    (on the CPU or on ``device_type``, whose memory is host memory too), else raise."""
    nbytes = dst.numel() * dst.element_size()
    for name, t in (("dst", dst), ("src", src)):
        if t.device.type not in ("cpu", device_type) or not t.is_contiguous():
            where = "CPU tensor" if device_type == "cpu" else f"tensor on cpu or {device_type}"
            raise ValueError(
                f"copy {name} must be a contiguous {where}, got {t.device} with strides "
                f"{t.stride()}"
            )
    if nbytes != src.numel() * src.element_size():
        raise ValueError(
            f"copy of {src.numel() * src.element_size()} bytes into a {nbytes}-byte tensor"
        )
    return nbytes


class CpuBackend(DeviceBackend):
    """Device slots in RAM, host<->device copies on one copy thread (in order)."""

    name = "cpu"
    shares_host_memory = True

    def __init__(self, copy_delay_s: float = 0.0, *, nvme_direct: bool = False) -> None:
        """``nvme_direct``: read NVMe homes straight into device slots, the route a
        GPU with GPU-direct storage takes (tests run it here; see :meth:`nvme_reader`)."""
        self.device = torch.device("cpu")
        self.copy_delay_s = copy_delay_s
        self.nvme_direct = nvme_direct
        self.direct_reads = 0  # requests issued by the reader (tests check the route ran)
        self._queue = _native.CopyQueue()
        self._inflight: deque[_CopyHandle] = deque()  # submission order = completion order

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        return self._submit(dst, src)

    def _submit(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        """Queue ``dst.copy_(src)`` on the copy thread, by address."""
        nbytes = _check_copy(dst, src, self.device.type)
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft()
        delay_us = int(self.copy_delay_s * 1e6)
        job = self._queue.submit(dst.data_ptr(), src.data_ptr(), nbytes, delay_us)
        handle = _CopyHandle(job, dst, src, self)
        self._inflight.append(handle)
        return handle

    def nvme_reader(self, swap_file: SwapFile) -> Callable[[torch.Tensor, int], IORequest] | None:
        # The device slots are RAM here, so the swap file's own reader can fill
        # them: the nvme -> device route with nothing but this method, as GPU-direct
        # storage would be on a GPU (NOTE [routes are data]).
        if not self.nvme_direct:
            return None

        def read(dst: torch.Tensor, offset: int) -> IORequest:
            self.direct_reads += 1
            return swap_file.read(dst, offset)

        return read

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        # NOTE: frombuffer over a ctypes array at the region's address gives a
        # new storage (it keeps the ctypes object, not our slab, alive), which
        # is what makes per-slot liveness observable.
        nbytes = region.numel() * region.element_size()
        buffer = (ctypes.c_uint8 * nbytes).from_address(region.data_ptr())
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def free_memory(self) -> int | None:
        # The kernel's estimate of what can be allocated without swapping
        # (page cache it can drop included); not known off Linux.
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def synchronize(self) -> None:
        if self._inflight:
            self._inflight[-1].wait()  # copies complete in submission order
        self._inflight.clear()

    def close(self) -> None:
        self._queue.close()  # finishes what is queued
        self._inflight.clear()
