"""Each tensor of one chunk, whatever shape the chunk takes: whole, or spans.

The one way for code outside the step to read or write the values of the
tensors in a chunk (state access, checkpoints): callers name the tensors'
slots and get flat values in order, never asking whether the chunk is whole,
sharded across ranks or oversize (moved in spans).

NOTE: an oversize chunk is larger than any staging slot, so it is never opened
whole: each tensor is read (or written) span by span through a transient copy
of that tensor alone. A whole chunk is opened once and every item is a view
into it. Either way the caller sees one flat tensor per slot.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from infinity.chunks.grad_flow import typed
from infinity.chunks.shards import close_whole, open_whole
from infinity.chunks.span_access import SpanAccess, read_elements, write_elements
from infinity.chunks.spans import is_split
from infinity.core.layout import TensorSlot
from infinity.core.names import Kind


def tensor_values(
    manager: SpanAccess,
    kind: Kind,
    chunk: int,
    slots: Sequence[TensorSlot],
    dtype: torch.dtype,
    *,
    write: bool = False,
    fill: bool = True,
    copy: bool = False,
    gather: bool = True,
    keep: bool = False,
) -> Generator[torch.Tensor, None, None]:
    """Flat values (``dtype``) of each of ``slots`` (all in ``chunk``) of ``kind``, in order.

    ``write``: what the caller leaves in an item is stored (an oversize chunk's
    tensor when the next item is drawn, a whole chunk's when the iteration
    ends). ``fill=False``: an oversize chunk's items start uninitialised (for
    writes of whole tensors; a whole chunk's items always hold its values).
    ``copy``: items the caller may keep (a whole chunk's views are cloned; an
    oversize chunk's are copies already). ``gather=False`` (sharded): the whole
    chunk holds only this rank's shard, enough for writes every rank makes
    alike (see :func:`~infinity.chunks.shards.open_whole`). ``keep`` leaves a
    whole chunk's NVMe staging copy cached.

    Wrap the iterator in :func:`contextlib.closing` where the caller may stop
    early or raise: closing it releases the chunk's staging copy at once.
    """
    if is_split(manager.plan, chunk):
        for slot in slots:
            end = slot.offset + slot.numel
            flat = (
                read_elements(manager, kind, chunk, 0, slot.offset, end, dtype).reshape(-1)
                if fill
                else torch.empty(slot.numel, dtype=dtype)
            )
            yield flat
            if write:
                write_elements(manager, kind, chunk, 0, slot.offset, flat)
        return
    region, handle = open_whole(manager, (kind, chunk), writable=write, gather=gather)
    try:
        whole = typed(region, dtype)
        for slot in slots:
            view = whole[slot.offset : slot.offset + slot.numel]
            yield view.clone() if copy else view
    finally:
        close_whole(manager, handle, modified=write, keep=keep)
