"""CUDA backend: device slots in GPU memory, copies on one persistent copy stream.

Kept thin and written against documented torch APIs only (streams, events,
``__cuda_array_interface__``); everything else is shared with the CPU backend.
NOTE: the copy stream is created once: streams made per step grow the caching
allocator without bound.
"""

from __future__ import annotations

from typing import cast

import torch

from infinity.devices.base import DeviceBackend, Event, EventClock, TransferHandle
from infinity.io import aligned_empty


def free_bytes(device: torch.device) -> int:
    """Bytes ``device`` could still allocate: what the driver has free plus what torch's
    caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + unused)


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class _EventHandle(TransferHandle):
    __slots__ = ("_clock", "_event")

    def __init__(self, event: torch.cuda.Event, clock: EventClock) -> None:
        self._event = event
        self._clock = clock

    def wait(self) -> None:
        with self._clock.stall():
            self._event.synchronize()

    def done(self) -> bool:
        return self._event.query()

    def wait_for_compute(self) -> None:
        with self._clock.stall():
            torch.cuda.current_stream().wait_event(self._event)


class _CudaRegion:
    """Exposes device memory through ``__cuda_array_interface__`` (for aliases)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "stream": None,
        }


class CudaBackend(DeviceBackend):
    """GPU slots; H2D/D2H copies on a side stream ordered after compute."""

    name = "cuda"
    computes_apart = True  # NOTE [host updates behind the forward]
    # NOTE [routes are data]: no `nvme_reader` yet, so NVMe bytes reach the GPU
    # through host staging; GPU-direct storage (cuFile) would be that one method.

    def __init__(self, device: torch.device) -> None:
        # NOTE: "cuda" means the current GPU (what torch.cuda.set_device(local_rank)
        # chose on each rank under torchrun), not GPU 0.
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device(device.type, index)
        self._stream = torch.cuda.Stream(self.device)
        self._compute = torch.cuda.current_stream(self.device)  # the clock's, per span
        self.events = EventClock(self._record, self._refresh)
        self.clock = self.events  # the base's default is the host's clock

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=True)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            start = _timed_event()
            start.record(self._stream)
            dst.copy_(src, non_blocking=True)
            event = _timed_event()
            event.record(self._stream)
        self.events.copied(dst.device.type == "cuda", start, event)
        return _EventHandle(event, self.events)

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        nbytes = region.numel() * region.element_size()
        return torch.as_tensor(_CudaRegion(region.data_ptr(), nbytes), device=self.device)

    def free_memory(self) -> int | None:
        return free_bytes(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _refresh(self) -> None:
        """Look the compute stream up again (the clock's span starts)."""
        self._compute = torch.cuda.current_stream(self.device)

    def _record(self, reuse: Event | None) -> torch.cuda.Event:
        """A timing event recorded on the compute stream: ``reuse`` (its time read, one
        of this clock's) or a new one (see NOTE in devices/base.py)."""
        event = cast(torch.cuda.Event, reuse) if reuse is not None else _timed_event()
        event.record(self._compute)
        return event
