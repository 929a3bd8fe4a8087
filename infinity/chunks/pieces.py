"""A chunk's pieces in host memory, whatever shape the chunk takes: one way to walk them.

The home of a ``(kind, chunk)`` holds one or more *pieces*: a parameter or
gradient chunk one, an optimizer unit its fp32 master (if any), then each state
slot's values and, for int8, its block scales. The host reaches them in
*windows* of elements, each with every piece's bytes over the same elements:

- a whole chunk is one window, opened whole (gathered from every rank's shard
  when sharded: :func:`~infinity.chunks.shards.open_whole`);
- an oversize chunk moved in spans (``chunks/spans.py``) is one window per
  span, never staged whole.

Callers (the step's readers, state access, checkpoints) walk
:func:`windows` and never ask which shape a chunk has; a checkpoint writes
:func:`home_bytes`, the home's bytes in order.

NOTE: a whole chunk's home aligns each piece (4 KiB), so a piece may be
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

NOTE: an oversize chunk is larger than any staging slot, so it is never opened
whole: each tensor is read (or written) span by span through a transient copy
of that tensor alone. A whole chunk is opened once and every item is a view
into it. Either way the caller sees one flat tensor per slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from contextlib import closing
from typing import Any, NamedTuple

import torch

from infinity.chunks.grad_flow import typed
from infinity.chunks.manager import ChunkManager
from infinity.chunks.shards import HostAccess, WholeChunk, close_whole, open_whole
from infinity.chunks.span_access import SpanAccess, open_span, read_elements, write_elements
from infinity.chunks.spans import SpanKey, is_split, part_ranges, span_key, span_ranges
from infinity.core.names import Kind
from infinity.core.plan import Plan, TensorSlot
from infinity.optim.chunk_optimizer import unit_ranges
from infinity.optim.state_formats import StateFormat


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
    manager: SpanAccess,
    kind: Kind,
    chunk: int,
    *,
    load: bool = True,
    write: bool = False,
    gather: bool = True,
    keep: bool = False,
) -> Generator[Window, None, None]:
    """Every window of ``(kind, chunk)`` in order (see the module docstring).

    ``load=False`` leaves a window's bytes unread (the caller writes all of
    them); ``write``: what the caller leaves in a window is stored when the
    next one is drawn. ``gather=False`` (sharded): a whole chunk holds only this
    rank's shard, the rest zeros, enough for element-wise changes and for
    writes every rank makes alike (:func:`~infinity.chunks.shards.open_whole`).
    ``keep`` leaves NVMe staging copies cached. Wrap the iterator in
    :func:`contextlib.closing` where the caller may stop early or raise.
    """
    if not is_split(manager.plan, chunk):
        yield from _whole(manager, kind, chunk, load, write, gather, keep)
        return
    for start, end in span_ranges(manager.plan, chunk):
        parts, copy = open_span(manager, kind, chunk, start, end, load=load, writable=write)
        try:
            yield Window(start, end, parts)
        finally:
            manager.close_host(copy, modified=write, keep=keep)


def _whole(
    manager: HostAccess, kind: Kind, chunk: int, load: bool, write: bool, gather: bool, keep: bool
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


def home_bytes(manager: SpanAccess, kind: Kind, chunk: int) -> Generator[torch.Tensor, None, None]:
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


class UpdateWindow(NamedTuple):
    """Elements ``[start, end)`` of chunk ``chunk`` opened for its optimizer update:
    the gradients and parameters (compute dtype) one piece each, the optimizer unit
    its pieces in home order (fp32 master, each state slot's values and int8
    scales), all uint8 and starting at element ``start``."""

    chunk: int
    start: int
    end: int
    grads: torch.Tensor
    unit: list[torch.Tensor]
    params: torch.Tensor
    handles: tuple[Any, Any, Any]  # what closes the gradients, the unit, the parameters


def opens_once(plan: Plan, chunk: int) -> bool:
    """The update of ``chunk`` is one window of this process's own homes: not spans of
    an oversize chunk, not gathered from other ranks (it waits on nobody once open)."""
    return not plan.sharded and not is_split(plan, chunk)


def update_windows(
    manager: ChunkManager, chunk: int, *, load_params: bool, gather: bool
) -> Generator[UpdateWindow, None, None]:
    """Every window of ``chunk``'s update, in order, each opened with
    :func:`open_update` and closed with :func:`close_update` when the next is drawn
    (a success) or the caller raises (a failure): an oversize chunk's spans, the
    next span's reads started while the caller computes on this one; else one
    window, this rank's home (``gather``: the whole chunk, gathered from every
    rank: collective). Wrap the iterator in :func:`contextlib.closing`.
    """
    plan = manager.plan
    if is_split(plan, chunk):
        ranges = span_ranges(plan, chunk)
    else:
        capacity = plan.layout.chunks[chunk].capacity
        ranges = [(0, capacity) if gather else plan.home_window(chunk)]
    kinds = [Kind.GRAD, Kind.OPTIM] + ([Kind.PARAM] if load_params else [])
    for position, (start, end) in enumerate(ranges):
        if position + 1 < len(ranges):
            # NOTE: the next span travels while the kernel runs on this one; the
            # current span's staged copies must not be its victims.
            current = {span_key(kind, chunk, start, end) for kind in kinds}
            for kind in kinds:
                manager.prefetch_host(span_key(kind, chunk, *ranges[position + 1]), current)
        window = open_update(manager, chunk, start, end, load_params=load_params, gather=gather)
        try:
            yield window
        except BaseException:
            close_update(manager, window, succeeded=False)
            raise
        close_update(manager, window, succeeded=True)


def open_update(
    manager: ChunkManager,
    chunk: int,
    start: int,
    end: int,
    *,
    load_params: bool,
    gather: bool = False,
) -> UpdateWindow:
    """Bring elements ``[start, end)`` of ``chunk``'s gradients, unit and parameters
    (read only if ``load_params``) to host memory: a span of an oversize chunk, this
    rank's home window, or (``gather``) the whole chunk, gathered from every rank
    when sharded (collective)."""
    plan = manager.plan
    if is_split(plan, chunk):
        opened: list[tuple[list[torch.Tensor], Any]] = []
        try:
            for kind, load, writable in _opens(load_params):
                opened.append(
                    open_span(manager, kind, chunk, start, end, load=load, writable=writable)
                )
        except BaseException:
            for _parts, copy in opened:
                manager.close_host(copy, modified=False, keep=True)
            raise
        (grad_parts, g), (unit_parts, o), (param_parts, p) = opened
        return UpdateWindow(chunk, start, end, grad_parts[0], unit_parts, param_parts[0], (g, o, p))
    handles: list[Any] = []
    regions: list[torch.Tensor] = []
    try:
        for kind, load, writable in _opens(load_params):
            key = (kind, chunk)
            if gather:
                region, handle = open_whole(manager, key, load=load, writable=writable)
            else:
                region, handle = manager.open_host(key, load=load, writable=writable)
            regions.append(region)
            handles.append(handle)
    except BaseException:
        for handle in handles:
            close_whole(manager, handle, modified=False, keep=True)
        raise
    grads, unit, params = regions
    width = end - start
    fmt = StateFormat(plan.state_dtype)
    ranges = unit_ranges(fmt, len(plan.state_slots), width, plan.has_master, 0, width)
    pieces = [unit[offset : offset + nbytes] for offset, nbytes in ranges if nbytes]
    grad, optim, param = handles
    return UpdateWindow(chunk, start, end, grads, pieces, params, (grad, optim, param))


def _opens(load_params: bool) -> list[tuple[Kind, bool, bool]]:
    """(kind, load, writable) of each key an update opens, in order."""
    return [(Kind.GRAD, True, False), (Kind.OPTIM, True, True), (Kind.PARAM, load_params, True)]


def close_update(manager: ChunkManager, window: UpdateWindow, *, succeeded: bool) -> None:
    """Write back what the update changed; after a success the gradients are consumed
    and the device's copy of the parameters, now stale, dropped.

    NOTE: write-backs finish in the background (keep=True): the slot is reused only
    once its write has landed, so window i-1 is written while window i computes and
    window i+1 is read.
    """
    grad, unit, params = window.handles
    close_whole(manager, grad, modified=False, keep=True)
    close_whole(manager, unit, modified=True, keep=True)
    close_whole(manager, params, modified=True, keep=True)
    if succeeded:
        manager.grad_flow.consume_grad(grad.copy if isinstance(grad, WholeChunk) else grad)
        manager.drop_param(window.chunk)
