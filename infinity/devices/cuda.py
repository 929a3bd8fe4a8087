"""CUDA backend: device slots in GPU memory, copies on one persistent copy stream.

Kept thin and written against documented torch APIs only (streams, events,
``__cuda_array_interface__``); everything else is shared with the CPU backend.
NOTE: the copy stream is created once: streams made per step grow the caching
allocator without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from infinity.devices.base import DeviceBackend, TransferHandle
from infinity.io import aligned_empty


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


# Timed pairs kept before the finished ones are folded into sums: a model run
# forward only (no optimizer step closes its spans) keeps this many at most.
_FOLD_AT = 1024


def _fold(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """Milliseconds of the finished pairs, which leave ``pairs``."""
    done = [i for i, (_, b) in enumerate(pairs) if b.query()]
    ms = sum(pairs[i][0].elapsed_time(pairs[i][1]) for i in done)
    for i in reversed(done):
        del pairs[i]
    return ms


class _EventHandle(TransferHandle):
    __slots__ = ("_clock", "_event")

    def __init__(self, event: torch.cuda.Event, clock: CudaBackend) -> None:
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
        # The step's clock (NOTE [the step's bound]): its span's first event, the
        # idle brackets inside it, and the copies' timed pairs (to the device: True).
        self._start: torch.cuda.Event | None = None
        self._depth = 0
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stalled_ms = 0.0
        self._copies: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []
        self._copied_ms = [0.0, 0.0]

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
        self._copies.append((dst.device.type == "cuda", start, event))
        if len(self._copies) > _FOLD_AT:
            pending = []
            for way, first, last in self._copies:
                if last.query():
                    self._copied_ms[0 if way else 1] += first.elapsed_time(last)
                else:
                    pending.append((way, first, last))
            self._copies = pending
        return _EventHandle(event, self)

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        nbytes = region.numel() * region.element_size()
        return torch.as_tensor(_CudaRegion(region.data_ptr(), nbytes), device=self.device)

    def free_memory(self) -> int | None:
        # What the driver has free plus what torch's caching allocator holds unused.
        free, _ = torch.cuda.mem_get_info(self.device)
        unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free + unused)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # --- the step's bound -------------------------------------------------------------
    # NOTE [the step's bound]: a pair of events brackets every wait of the engine and
    # every host update run inside the step (``stall``). The GPU reaches the first
    # event when its queued work is done and the second when the host, done, records
    # it: the time between them is exactly the time the GPU idled for the engine (0
    # if it was still busy). The engine's hooks are bracketed too (runtime/hooks.py).
    # The step's compute is its span, from its first forward to ``optimizer.step()``,
    # less those idle times: the model's own kernels and launches, as plain PyTorch's.
    def _record(self) -> torch.cuda.Event:
        event = _timed_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def open_span(self) -> None:
        if self._start is None:
            self._start = self._record()
            self._stalls, self._stalled_ms = [], 0.0

    @contextmanager
    def stall(self) -> Iterator[None]:
        outermost = self._start is not None and self._depth == 0
        first = self._record() if outermost else None
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if first is not None:
                self._stalls.append((first, self._record()))
                if len(self._stalls) > _FOLD_AT:
                    self._stalled_ms += _fold(self._stalls)

    def close_span(self) -> Callable[[], float]:
        start, stalls, stalled_ms = self._start, self._stalls, self._stalled_ms
        self._start, self._stalls, self._stalled_ms = None, [], 0.0
        if start is None:
            return lambda: 0.0
        end = self._record()

        def seconds() -> float:
            end.synchronize()
            idle = stalled_ms + sum(a.elapsed_time(b) for a, b in stalls)
            return max(0.0, start.elapsed_time(end) - idle) / 1e3

        return seconds

    def take_link_seconds(self) -> Callable[[], tuple[float, float]]:
        copies, folded = self._copies, self._copied_ms
        self._copies, self._copied_ms = [], [0.0, 0.0]

        def seconds() -> tuple[float, float]:
            ms = list(folded)
            for way, first, last in copies:
                last.synchronize()
                ms[0 if way else 1] += first.elapsed_time(last)
            return ms[0] / 1e3, ms[1] / 1e3

        return seconds
