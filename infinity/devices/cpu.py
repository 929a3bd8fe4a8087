"""CPU backend: the "device" tier is a budgeted pool in RAM, copies run on a thread.

NOTE: copies are deliberately asynchronous even though a memcpy would do: the
engine then has the same races as on a GPU, and tests catch a missing wait.
``copy_delay_s`` widens that window for tests.
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infinity.devices.base import DeviceBackend, TransferHandle
from infinity.io import aligned_empty


class _FutureHandle(TransferHandle):
    __slots__ = ("_future",)

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()


class CpuBackend(DeviceBackend):
    """Device slots in RAM, host<->device copies on one copy thread (in order)."""

    name = "cpu"

    def __init__(self, copy_delay_s: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.copy_delay_s = copy_delay_s
        # One worker keeps copies in submission order, like a CUDA copy stream.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-copy")

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        dst.copy_(src)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        return _FutureHandle(self._executor.submit(self._copy, dst, src))

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        # NOTE: frombuffer over a ctypes array at the region's address gives a
        # new storage (it keeps the ctypes object, not our slab, alive), which
        # is what makes per-slot liveness observable.
        nbytes = region.numel() * region.element_size()
        buffer = (ctypes.c_uint8 * nbytes).from_address(region.data_ptr())
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def synchronize(self) -> None:
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
