"""One offloaded saved tensor: where its bytes are, and the handle autograd holds.

:class:`_Record` is the store's side (in order, for eviction and read-ahead);
:class:`SavedActivation` is autograd's (its ``__del__`` tells the store the
tensor is done). :func:`_flat` and :func:`_restore` turn a tensor into the bytes
that travel and back, strides kept.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from infinity.io import IORequest, SwapFile


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
