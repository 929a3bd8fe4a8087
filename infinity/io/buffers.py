"""``aligned_empty``: 4 KiB-aligned host tensors of exact size, for O_DIRECT I/O.

``torch.empty`` gives no alignment guarantee and ``tensor.pin_memory()`` goes
through torch's caching host allocator, which rounds every block up to a power
of two (a 5 GiB pool would cost 8 GiB). These buffers are anonymous memory
mappings instead: page aligned, exactly the requested size rounded up to 4 KiB,
returned to the system when the last tensor viewing them dies.
See NOTE [O_DIRECT alignment] (docs/NOTES.md).
"""

from __future__ import annotations

import mmap

import torch

from infinity._native.io import ALIGNMENT
from infinity.utils.sizes import align_up


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
    freed when the tensor and every view of it are gone.

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
    # MAP_PRIVATE, not mmap's default MAP_SHARED: see NOTE [fork and native threads].
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    region = _HostRegion(-1, align_up(nbytes, ALIGNMENT), flags=flags)
    tensor = torch.frombuffer(region, dtype=dtype, count=nbytes // itemsize)
    if pin:
        ptr = tensor.data_ptr()
        status = torch.cuda.cudart().cudaHostRegister(ptr, len(region), 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {len(region)} bytes failed: status {status}")
        region.cuda_registered_ptr = ptr
    return tensor
