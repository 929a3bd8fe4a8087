"""Argument checks done in Python before anything reaches the native engine.

Everything that could make a pointer wrong (device, layout, contiguity, lazy
conj/neg views) or break the O_DIRECT contract (alignment of address, length
and offset) is rejected here with a message that names the value and what
would work.

See NOTE [raw pointers into native code] and NOTE [O_DIRECT alignment] (docs/NOTES.md).
"""

from __future__ import annotations

import os
import stat
from typing import Any

import torch

from infinity._native.io import ALIGNMENT


def check_tensor(tensor: Any, what: str = "tensor") -> tuple[int, int]:
    """Return ``(data_ptr, nbytes)`` of a tensor the engine may transfer, else raise.

    Raises TypeError for a non-tensor and ValueError for anything the engine
    cannot use directly (no bounce buffers are made: see :class:`IOEngine`).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} is on {tensor.device}; the I/O engine moves host memory only: "
            "copy through a CPU tensor from infinity.io.aligned_empty()"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} has layout {tensor.layout}; only dense (strided) tensors")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{what} is a lazy conj/neg view; call .resolve_conj()/.resolve_neg()")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the engine needs one contiguous byte range")
    nbytes = tensor.numel() * tensor.element_size()
    ptr = tensor.data_ptr()
    if ptr % ALIGNMENT:
        raise ValueError(
            f"{what}.data_ptr()=0x{ptr:x} is not {ALIGNMENT}-byte aligned (O_DIRECT needs aligned "
            "buffers); allocate it with infinity.io.aligned_empty()"
        )
    if nbytes % ALIGNMENT:
        raise ValueError(
            f"{what} has {nbytes} bytes, not a multiple of {ALIGNMENT} (O_DIRECT needs whole "
            f"{ALIGNMENT // 1024} KiB blocks); pad the buffer"
        )
    return ptr, nbytes


def check_offset(offset: Any) -> int:
    """Return ``offset`` if it is a non-negative multiple of ``ALIGNMENT``, else raise."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset={offset} is negative")
    if offset % ALIGNMENT:
        raise ValueError(
            f"offset={offset} is not a multiple of {ALIGNMENT} (O_DIRECT alignment); "
            f"e.g. {offset // ALIGNMENT * ALIGNMENT} or {(offset // ALIGNMENT + 1) * ALIGNMENT}"
        )
    return offset


def resolve_file(target: Any) -> tuple[int, str]:
    """``(fd, path)`` of an int fd or an object with ``.fileno()`` (and ``.path`` or ``.name``)."""
    if isinstance(target, bool):
        raise TypeError("fd_or_file must be a file descriptor or a file object, got a bool")
    if isinstance(target, int):
        fd = target
        path = None
    elif callable(getattr(target, "fileno", None)):
        fd = target.fileno()
        path = getattr(target, "path", None) or getattr(target, "name", None)
    else:
        raise TypeError(
            "fd_or_file must be a SwapFile, an object with .fileno() and .path, or an int fd; "
            f"got {type(target).__name__}"
        )
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise ValueError(f"fileno()={fd!r} is not an open file descriptor")
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ValueError(f"file descriptor {fd} is not open ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        raise ValueError(f"file descriptor {fd} is not a regular file or block device")
    if not isinstance(path, (str, os.PathLike)):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"<fd {fd}>"
    return fd, os.fspath(path)
