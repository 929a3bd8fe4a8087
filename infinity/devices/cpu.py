"""CPU backend: the "device" tier is a budgeted pool in RAM, copies run on a thread.

NOTE: copies are deliberately asynchronous even though a memcpy would do: the
engine then has the same races as on a GPU, and tests catch a missing wait.
``copy_delay_s`` widens that window for tests.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from concurrent.futures import Future

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


class _CopyThread:
    """One daemon worker running copies in submission order, like a CUDA copy stream.

    NOTE: not a ThreadPoolExecutor: executors refuse work once the interpreter
    starts shutting down, which is exactly when the engine's finalizer waits
    for the last copies.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infinity-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

    def submit(self, fn) -> Future[None]:
        future: Future[None] = Future()
        if not self._thread.is_alive():
            raise RuntimeError("the copy thread has stopped")
        self._queue.put((future, fn))
        return future

    @property
    def alive(self) -> bool:
        """The worker still runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class CpuBackend(DeviceBackend):
    """Device slots in RAM, host<->device copies on one copy thread (in order)."""

    name = "cpu"

    def __init__(self, copy_delay_s: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.copy_delay_s = copy_delay_s
        self._worker = _CopyThread()

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        # NOTE: a plain single-threaded memmove (ctypes releases the GIL), not
        # dst.copy_(src): torch's copy opens an OpenMP team of its own on this
        # thread, which fights the compute thread's team for the same cores
        # (spin-waiting threads doubled step times on a 2-core machine).
        nbytes = dst.numel() * dst.element_size()
        assert (
            nbytes == src.numel() * src.element_size()
            and dst.is_contiguous()
            and src.is_contiguous()
        )
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        return _FutureHandle(self._worker.submit(lambda: self._copy(dst, src)))

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        # NOTE: frombuffer over a ctypes array at the region's address gives a
        # new storage (it keeps the ctypes object, not our slab, alive), which
        # is what makes per-slot liveness observable.
        nbytes = region.numel() * region.element_size()
        buffer = (ctypes.c_uint8 * nbytes).from_address(region.data_ptr())
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def synchronize(self) -> None:
        if self._worker.alive:
            self._worker.submit(lambda: None).result()

    def close(self) -> None:
        self._worker.stop()
