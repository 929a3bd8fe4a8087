"""A chunk's pieces in host memory, whatever shape the chunk takes: one way to walk them.

The home of a ``(kind, chunk)`` holds one or more *pieces*: a parameter or
gradient chunk one, an optimizer unit its fp32 master (if any), then each state
slot's values and, for int8, its block scales. The host reaches them in
*windows* of elements, each with every piece's bytes over the same elements:

- a whole chunk is one window, opened whole (gathered from every rank's shard
  when sharded: :func:`~infinity.chunks.shards.open_whole`);
- an oversize chunk moved in spans (``chunks/pools.py``) is one window per
  span, never staged whole.

Callers (the step's readers, state access, checkpoints) walk
:func:`windows` and never ask which shape a chunk has; a checkpoint writes
:func:`home_bytes`, the home's bytes in order.

A whole chunk's home aligns each piece (4 KiB), so a piece may be
followed by padding; here the padding belongs to the piece before it (its
part runs up to the next piece, the last one to the home's end). The parts of
every window, piece after piece, are then exactly the home's bytes, and a
window written whole (its parts zeroed first) leaves no byte to chance.
Callers index parts from their start and never rely on their length.

Each tensor of one chunk, whatever shape the chunk takes (:func:`tensor_values`):
the one way for code outside the step to read or write the values of the
tensors in a chunk (state access, checkpoints): callers name the tensors'
slots and get flat values in order, never asking whether the chunk is whole,
sharded across ranks or oversize (moved in spans).

An oversize chunk is larger than any staging slot, so it is never opened
whole: each tensor is read (or written) span by span through a transient copy
of that tensor alone (:func:`read_elements`, :func:`write_elements`, each span
opened with ``ChunkManager.open_span``, so at most a couple of normal-size
staging slots are held at a time, whatever the chunk's size). A whole chunk is
opened once and every item is a view into it. Either way the caller sees one
flat tensor per slot. A chunk's initial values are written the same way
(:func:`write_initial`).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from typing import NamedTuple

import torch

from infinity.chunks.manager import ChunkManager
from infinity.chunks.pools import SpanKey, is_split, part_ranges, span_key, span_ranges
from infinity.chunks.shards import close_whole, open_whole
from infinity.core.names import Kind
from infinity.core.plan import TensorSlot


class Window(NamedTuple):
    """Elements ``[start, end)`` of a chunk in host memory, as each piece's bytes."""

    start: int
    end: int
    parts: list[torch.Tensor]  # uint8: one per piece, in home order

    def overlap(self, offset: int, numel: int) -> tuple[slice, slice] | None:
        """Where elements ``[offset, offset + numel)`` of the chunk (a tensor) meet this
        window: ``(elements of the tensor, elements of the window)``, or ``None``."""
        first, last = max(self.start, offset), min(self.end, offset + numel)
        if first >= last:
            return None
        return slice(first - offset, last - offset), slice(first - self.start, last - self.start)


def windows(
    manager: ChunkManager,
    kind: Kind,
    chunk: int,
    *,
    load: bool = True,
    write: bool = False,
    gather: bool = True,
    keep: bool = False,
    ahead: bool = False,
) -> Generator[Window, None, None]:
    """Every window of ``(kind, chunk)`` in order (see the module docstring).

    ``load=False`` leaves a window's bytes unread (the caller writes all of
    them); ``write``: what the caller leaves in a window is stored when the
    next one is drawn. ``gather=False`` (sharded): a whole chunk holds only this
    rank's shard, the rest zeros, enough for element-wise changes and for
    writes every rank makes alike (:func:`~infinity.chunks.shards.open_whole`).
    ``keep`` leaves NVMe staging copies cached; ``ahead`` starts reading the
    next span while the caller works on one. Wrap the iterator in
    :func:`contextlib.closing` where the caller may stop early or raise.
    """
    if not is_split(manager.plan, chunk):
        yield from _whole(manager, kind, chunk, load, write, gather, keep)
        return
    ranges = span_ranges(manager.plan, chunk)
    for position, (start, end) in enumerate(ranges):
        if ahead and load and position + 1 < len(ranges):
            current = span_key(kind, chunk, start, end)
            manager.prefetch_host(span_key(kind, chunk, *ranges[position + 1]), {current})
        parts, copy = manager.open_span(kind, chunk, start, end, load=load, writable=write)
        try:
            yield Window(start, end, parts)
        finally:
            manager.close_host(copy, modified=write, keep=keep)


def _whole(
    manager: ChunkManager, kind: Kind, chunk: int, load: bool, write: bool, gather: bool, keep: bool
) -> Generator[Window, None, None]:
    """The one window of a chunk that is not moved in spans."""
    capacity = manager.plan.layout.chunks[chunk].capacity
    region, handle = open_whole(manager, (kind, chunk), load=load, writable=write, gather=gather)
    try:
        starts = [
            offset for offset, _n in part_ranges(manager.plan, SpanKey(kind, chunk, 0, capacity))
        ]
        bounds = [*starts, region.numel()]
        yield Window(0, capacity, [region[a:b] for a, b in itertools.pairwise(bounds)])
    finally:
        close_whole(manager, handle, modified=write, keep=keep)


def home_bytes(
    manager: ChunkManager, kind: Kind, chunk: int
) -> Generator[torch.Tensor, None, None]:
    """The bytes of ``(kind, chunk)``'s home in order (every rank's shard when sharded):
    piece after piece, each window after window.

    A window is opened once per piece, so at most one span is staged at a time;
    a window that covers the whole chunk gives every piece from one opening. A
    unit without pieces (no master and no state slot: CPUAdafactor in fp32) has
    no bytes wherever it is homed (an NVMe staging slot, sized for Adam's unit,
    is not its bytes).
    """
    piece, count = 0, 1
    while piece < count:
        with closing(windows(manager, kind, chunk)) as each:
            for window in each:
                count = len(window.parts)
                if piece >= count:
                    return  # a unit without pieces (no master, no state slot)
                if window.end - window.start == manager.plan.layout.chunks[chunk].capacity:
                    yield from window.parts
                    return
                yield window.parts[piece]
        piece += 1


def tensor_values(
    manager: ChunkManager,
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
        whole = region.view(dtype)
        for slot in slots:
            view = whole[slot.offset : slot.offset + slot.numel]
            yield view.clone() if copy else view
    finally:
        close_whole(manager, handle, modified=write, keep=keep)


def write_initial(
    manager: ChunkManager, i: int, values: torch.Tensor, *, background: bool = False
) -> None:
    """Set chunk ``i``'s parameters (and fp32 master, zero moments) from fp32 ``values``.

    With ``background`` the NVMe writes are left in flight and their staging
    copies cached (a slot waits for its write only when reused), so that
    initialising a large model overlaps the disk with the next chunks' compute.
    """
    plan = manager.plan
    if is_split(plan, i):
        write_initial_spans(manager, i, values)
        return
    if plan.sharded:
        # Like DDP, every rank starts from rank 0's values (ranks seeded
        # alike agree anyway; ranks that were not must still train one model).
        manager.collectives.broadcast(values, f"initialising chunk {i}")
        start, end = plan.home_window(i)
        values = values[start:end]
    region, copy = manager.open_host((Kind.PARAM, i), load=False)
    region.view(manager.dtype).copy_(values)
    manager.close_host(copy, modified=True, keep=background)
    if plan.grad_home[i] is None:
        return
    region, copy = manager.open_host((Kind.OPTIM, i), load=False)
    region.zero_()
    if plan.has_master:
        region[: values.numel() * 4].view(torch.float32).copy_(values)
    manager.close_host(copy, modified=True, keep=background)


def write_initial_spans(manager: ChunkManager, chunk: int, values: torch.Tensor) -> None:
    """``write_initial`` of an oversize chunk: parameters (and fp32 master, zero
    moments) from fp32 ``values``, span by span."""
    trainable = manager.plan.grad_home[chunk] is not None
    for start, end in span_ranges(manager.plan, chunk):
        parts, copy = manager.open_span(Kind.PARAM, chunk, start, end, load=False)
        parts[0].view(manager.dtype).copy_(values[start:end])
        manager.close_host(copy, modified=True)
        if not trainable:
            continue
        parts, copy = manager.open_span(Kind.OPTIM, chunk, start, end, load=False)
        for part in parts:
            part.zero_()  # zero moments in every format (int8: zero scales)
        if manager.plan.has_master:
            parts[0].view(torch.float32).copy_(values[start:end])
        manager.close_host(copy, modified=True)


def each_span(
    manager: ChunkManager,
    kind: Kind,
    chunk: int,
    start: int,
    end: int,
    *,
    load: bool = True,
    modify: bool = False,
) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Elements ``[start, end)`` of ``(kind, chunk)``, one span at a time: yields the
    position in the range and each part's bytes (uint8) of the span's overlap.
    With ``modify`` the span is written back once the caller moves on."""
    for low, high in span_ranges(manager.plan, chunk):
        first, last = max(low, start), min(high, end)
        if first >= last:
            continue
        parts, copy = manager.open_span(kind, chunk, low, high, load=load, writable=modify)
        try:
            if (first, last) == (low, high):
                yield first - start, parts
                continue
            width = high - low
            views = []
            for part in parts:
                size, rest = divmod(part.numel(), width)
                if rest or not size:
                    # int8 block scales are not per element; callers cut a
                    # partial span of an optimizer unit with ChunkOptimizer.piece_views.
                    raise AssertionError(f"piece of {part.numel()} bytes is not per element")
                views.append(part[(first - low) * size : (last - low) * size])
            yield first - start, views
        finally:
            manager.close_host(copy, modified=modify)


def read_elements(
    manager: ChunkManager,
    kind: Kind,
    chunk: int,
    part: int,
    start: int,
    end: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A new flat tensor of elements ``[start, end)`` of part ``part`` of ``(kind, chunk)``."""
    out = torch.empty(end - start, dtype=dtype)
    for at, parts in each_span(manager, kind, chunk, start, end):
        piece = parts[part].view(dtype)
        out[at : at + piece.numel()].copy_(piece)
    return out


def write_elements(
    manager: ChunkManager, kind: Kind, chunk: int, part: int, start: int, values: torch.Tensor
) -> None:
    """Set elements ``[start, start + len(values))`` of part ``part`` of ``(kind, chunk)``."""
    flat = values.reshape(-1)
    end = start + flat.numel()
    for at, parts in each_span(manager, kind, chunk, start, end, modify=True):
        piece = parts[part].view(flat.dtype)
        piece.copy_(flat[at : at + piece.numel()])
