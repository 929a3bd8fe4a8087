"""``aligned_empty``: 4 KiB-aligned host tensors of exact size, for O_DIRECT I/O.

``torch.empty`` gives no alignment guarantee and ``tensor.pin_memory()`` goes
through torch's caching host allocator, which rounds every block up to a power
of two (a 5 GiB pool would cost 8 GiB). These buffers are anonymous memory
mappings instead: page aligned, exactly the requested size rounded up to 4 KiB,
returned to the system when the last tensor viewing them dies; large ones are
backed by transparent huge pages (see NOTE [huge I/O buffers], docs/NOTES.md).
See NOTE [O_DIRECT alignment] (docs/NOTES.md).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from infinity._native.io import ALIGNMENT
from infinity.utils.sizes import align_up

# Transparent huge page size (x86-64 and arm64 with 4 KiB pages).
HUGE_PAGE = 2 << 20
# Regions at least this large get huge pages: rounding the last one up costs
# at most 1/8 more memory. See NOTE [huge I/O buffers].
MIN_HUGE_BYTES = 16 << 20


class _HostRegion(mmap.mmap):
    """An anonymous private mapping that can be registered with CUDA.

    NOTE: a subclass so ``__del__`` runs *before* ``mmap``'s own deallocation
    unmaps the memory: ``cudaHostUnregister`` must see the range still mapped.
    ``torch.frombuffer`` keeps this object alive as long as any tensor (or
    view) uses the memory, so ``__del__`` runs exactly when the last one dies.
    """

    cuda_registered_ptr: int = 0

    def __del__(self) -> None:
        if self.cuda_registered_ptr:
            torch.cuda.cudart().cudaHostUnregister(self.cuda_registered_ptr)
            self.cuda_registered_ptr = 0


def _want_pinned(pinned: bool | str) -> bool:
    if pinned == "auto":
        return torch.cuda.is_available()
    if pinned is True:
        if not torch.cuda.is_available():
            raise ValueError(
                "pinned=True needs CUDA to register the memory with, and CUDA is not "
                "available here; use pinned='auto' or pinned=False"
            )
        return True
    if pinned is False:
        return False
    raise ValueError(f"pinned={pinned!r} must be True, False or 'auto'")


def aligned_empty(
    nbytes: int, dtype: torch.dtype = torch.uint8, *, pinned: bool | str = "auto"
) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes // itemsize`` uninitialised elements in 4 KiB-aligned memory.

    The memory is an anonymous mapping of exactly ``nbytes`` rounded up to a
    multiple of 4096 (never a power-of-two rounding), so ``data_ptr()`` is
    4096-aligned; if ``nbytes`` is a multiple of 4096 the tensor can be read
    and written by :class:`~infinity.io.IOEngine` directly. The memory is
    freed when the tensor and every view of it are gone. From 16 MiB up the
    buffer starts on a 2 MiB boundary and asks for transparent huge pages
    (rounded up to whole 2 MiB pages, at most 1/8 more): O_DIRECT transfers
    then reach the disk as requests of the full block size, not ~1 MiB
    pieces. See NOTE [huge I/O buffers] (docs/NOTES.md).

    Args:
        nbytes: size in bytes; must be a multiple of ``dtype``'s item size.
        dtype: element type of the returned tensor.
        pinned: ``True`` registers the memory with CUDA (``cudaHostRegister``)
            for asynchronous host-to-device copies (needs CUDA); ``False``
            leaves it pageable; ``"auto"`` pins when CUDA is available.

    Raises:
        ValueError: for a negative size, a size that is not a whole number of
            elements, a bad ``pinned`` value, or ``pinned=True`` without CUDA.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} must be an int >= 0")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r} must be a torch.dtype")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(
            f"nbytes={nbytes} is not a whole number of {dtype} elements ({itemsize} bytes each)"
        )
    pin = _want_pinned(pinned)
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    region, offset, size = _map(nbytes)
    tensor = torch.frombuffer(region, dtype=dtype, count=nbytes // itemsize, offset=offset)
    if pin:
        ptr = tensor.data_ptr()
        status = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: status {status}")
        region.cuda_registered_ptr = ptr
    return tensor


def _map(nbytes: int) -> tuple[_HostRegion, int, int]:
    """(mapping, offset of the buffer in it, usable bytes from there) for ``nbytes``."""
    # MAP_PRIVATE, not mmap's default MAP_SHARED: see NOTE [fork and native threads].
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    size = align_up(nbytes, ALIGNMENT)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < MIN_HUGE_BYTES or advice is None:
        return _HostRegion(-1, size, flags=flags), 0, size
    # See NOTE [huge I/O buffers]: start on a huge page boundary (the slack
    # before it is address space only, never touched) and end on one.
    size = align_up(size, HUGE_PAGE)
    region = _HostRegion(-1, size + HUGE_PAGE, flags=flags)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE_PAGE
    try:
        region.madvise(advice, offset, size)
    except OSError:
        pass  # a kernel without transparent huge pages: small pages, as before
    return region, offset, size
