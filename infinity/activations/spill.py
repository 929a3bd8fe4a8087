"""Where an offloaded saved tensor's bytes are: swap-file space for activations beyond
host memory, the record of each tensor, and the handle autograd holds.

Segments are swap files opened as the first steps need them (their size is not
known before a step has run) and kept for the next steps; a bump cursor hands
out 4 KiB-aligned extents in order and rewinds when no extent is live (every
saved tensor of the step was used by backward, or its graph was dropped).

:class:`_Record` is the store's side (in order, for eviction and read-ahead);
:class:`SavedActivation` is autograd's (its ``__del__`` tells the store the
tensor is done). :func:`_flat` and :func:`_restore` turn a tensor into the bytes
that travel and back, strides kept.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from infinity.config import AioConfig, ConfigError
from infinity.io import IOEngine, IORequest, SwapFile
from infinity.utils.sizes import align_up, format_size

ALIGN = 4096
MIN_SEGMENT = 256 << 20  # a new segment is at least this, or the space used so far


class ActivationSpill:
    """Extents in growing swap files under ``directory`` (at most ``limit`` bytes)."""

    def __init__(
        self,
        directory: str,
        aio: AioConfig,
        limit: int | None,
        on_open: Callable[[SwapFile], None] = lambda swap: None,
    ) -> None:
        self._directory = directory
        self._aio = aio
        self._limit = limit
        self._on_open = on_open
        self._engine: IOEngine | None = None
        self.segments: list[SwapFile] = []
        self._segment = 0  # cursor: segment index and offset in it
        self._offset = 0
        self.live = 0  # extents handed out and not yet released

    @property
    def engine(self) -> IOEngine:
        """The I/O engine of the segments (made on first use)."""
        if self._engine is None:
            self._engine = IOEngine(self._aio)
        return self._engine

    @property
    def capacity(self) -> int:
        """Bytes of all segments."""
        return sum(s.nbytes for s in self.segments)

    @property
    def limit(self) -> int | None:
        """Bytes the segments may reach (``None``: as much as the disk holds)."""
        return self._limit

    def room(self, live_bytes: int) -> int | None:
        """Bytes more that activations may put here beside ``live_bytes``: up to the
        limit, or what the segments have free plus the disk's free space (``None``:
        the disk's free space is not known)."""
        if self._limit is not None:
            return max(0, self._limit - live_bytes)
        try:
            free = shutil.disk_usage(self._directory).free
        except OSError:
            return None
        return max(0, self.capacity - live_bytes) + free

    def allocate(self, nbytes: int) -> tuple[SwapFile, int]:
        """An extent of ``nbytes`` (rounded up to 4 KiB): its file and offset."""
        size = align_up(max(nbytes, 1), ALIGN)
        while self._segment < len(self.segments):
            swap = self.segments[self._segment]
            if self._offset + size <= swap.nbytes:
                break
            self._segment, self._offset = self._segment + 1, 0
        else:
            self.segments.append(self._open(size))
        swap = self.segments[self._segment]
        offset = self._offset
        self._offset += size
        self.live += 1
        return swap, offset

    def release(self) -> None:
        """One extent is no longer needed; with none live, the cursor rewinds."""
        self.live -= 1
        if self.live == 0:
            self._segment = self._offset = 0

    def _open(self, size: int) -> SwapFile:
        total = self.capacity
        nbytes = max(size, MIN_SEGMENT, total)
        if self._limit is not None:
            # NOTE: whole 4 KiB blocks only (O_DIRECT); a limit that is not a multiple
            # made a segment size the swap file refused.
            nbytes = min(nbytes, (self._limit - total) // ALIGN * ALIGN)
            if nbytes < size:
                raise ConfigError(
                    f"activations need {format_size(total + size)} ({total + size} bytes) of "
                    f"NVMe beyond the states, over the {format_size(self._limit)} that "
                    "nvme_memory leaves them; raise nvme_memory, lower the tokens per step, "
                    "or use activations='checkpoint'"
                )
        swap = SwapFile(
            self._directory, nbytes, self.engine, name=f"activations-{len(self.segments)}"
        )
        self._on_open(swap)
        return swap

    def close(self) -> None:
        """Wait for every transfer, remove the files, stop the I/O workers."""
        try:
            for swap in self.segments:
                swap.close()
        finally:
            self.segments.clear()
            if self._engine is not None:
                self._engine.close()


class _Store(Protocol):
    """What a handle needs of the store (not the store's module: no cycle)."""

    def drop(self, saved: _Record) -> None: ...


class _Record:
    """Where one offloaded tensor's bytes are (the store's side of a handle)."""

    __slots__ = (
        "dropped", "dtype", "failed", "file", "host", "kept", "nbytes", "offset", "read",
        "seq", "shape", "span", "stride", "used", "write",
    )  # fmt: skip

    def __init__(self, seq: int, tensor: torch.Tensor) -> None:
        self.seq = seq
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        # Elements from the first to the last the tensor reaches in its storage: the
        # bytes travel as that span (strides kept, an expanded tensor stays small)
        # unless it is mostly gaps; 0: as values in contiguous order.
        span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
        self.span = span if span <= 2 * tensor.numel() else 0
        self.nbytes = (self.span or tensor.numel()) * tensor.element_size()
        self.host: torch.Tensor | None = None
        self.file: SwapFile | None = None  # set once the bytes go to NVMe
        self.offset = 0
        # A write in flight (its buffer still holds the bytes); a read started ahead.
        self.write: tuple[IORequest, torch.Tensor] | None = None
        self.read: tuple[IORequest, torch.Tensor] | None = None
        self.failed: BaseException | None = None  # its write failed
        self.kept = False  # `read` is the buffer that wrote it (no read from the disk)
        self.dropped = False  # autograd let go of it
        self.used = False  # unpacked once: not read ahead again


class SavedActivation:
    """What autograd holds for one offloaded saved tensor; dropping it frees the bytes.

    NOTE: a handle apart from its record, because the store must keep records
    (in order, for eviction and read-ahead) without keeping autograd's handle
    alive: the handle's ``__del__`` is how the store learns a tensor is done.
    """

    __slots__ = ("record", "store")

    def __init__(self, store: _Store, record: _Record) -> None:
        self.store = weakref.ref(store)
        self.record = record

    def __del__(self) -> None:
        store = self.store()
        if store is not None:
            store.drop(self.record)


def _flat(saved: _Record, tensor: torch.Tensor) -> torch.Tensor:
    """The saved tensor's bytes as they travel: a 1-D tensor of its dtype."""
    tensor = tensor.detach()
    if saved.span:
        return tensor.as_strided((saved.span,), (1,), tensor.storage_offset())
    return tensor.reshape(-1)


def _restore(saved: _Record, flat: torch.Tensor) -> torch.Tensor:
    """The saved tensor, with its shape and strides, from what :func:`_flat` gave.

    NOTE: strides matter: a backward compiled by ``torch.compile`` asserts the
    strides of what it saved. A tensor that travelled as values in contiguous
    order is laid out again (one copy, only when it was mostly gaps)."""
    if saved.span:
        return flat.as_strided(saved.shape, saved.stride, 0)
    values = flat.view(saved.shape)
    if values.stride() == saved.stride:
        return values
    out = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=flat.device)
    return out.copy_(values)
