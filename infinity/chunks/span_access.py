"""A chunk's bytes in host memory beyond its home: an oversize chunk span by span
(see ``chunks/spans.py``), a sharded chunk whole (:func:`open_whole`).

Functions over a :class:`~infinity.chunks.manager.ChunkManager` (above it: the
manager never calls them): open one span of a key for the optimizer or a
checkpoint, write a chunk's initial values, open a sharded chunk whole (a device
fill span by span is ``chunks/movers.py``'s ``SpanFill``). Each span holds at
most a couple of normal-size staging slots at a time, whatever the chunk's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from infinity.chunks.cache import Copy
from infinity.chunks.manager import ChunkManager
from infinity.chunks.shards import gather_whole, place_shard, take_shard, whole_bytes
from infinity.chunks.spans import SpanKey, is_split, part_ranges, span_key, span_ranges
from infinity.core.names import HOST, Key, Kind


def open_span(
    manager: ChunkManager,
    kind: Kind,
    chunk: int,
    start: int,
    end: int,
    *,
    load: bool = True,
    writable: bool = True,
) -> tuple[list[torch.Tensor], Copy | None]:
    """Host bytes (uint8) of elements ``[start, end)`` of every part of ``(kind, chunk)``;
    pair with ``manager.close_host(copy, ...)``.

    A host-homed key gives slices of its home (no copy); an NVMe-homed one a
    staging copy of the span, read first if ``load``.
    """
    key: Key = (kind, chunk)
    span = SpanKey(kind, chunk, start, end)
    capacity = manager.plan.layout.chunks[chunk].capacity
    ranges = part_ranges(manager.plan, span)
    if manager.homes.tier(key) == HOST:
        region, _none = manager.open_host(key, load=load, writable=writable)
        return [region[offset : offset + nbytes] for offset, nbytes in ranges], None
    if not is_split(manager.plan, chunk) and (start, end) == (0, capacity):
        region, copy = manager.open_host(key, load=load, writable=writable)
    else:
        region, copy = manager.open_host(
            span_key(kind, chunk, start, end), load=load, writable=writable
        )
    parts, at = [], 0
    for _offset, nbytes in ranges:
        parts.append(region[at : at + nbytes])
        at += nbytes
    return parts, copy


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
        assert manager.collectives is not None
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
        parts, copy = open_span(manager, Kind.PARAM, chunk, start, end, load=False)
        parts[0].view(manager.dtype).copy_(values[start:end])
        manager.close_host(copy, modified=True)
        if not trainable:
            continue
        parts, copy = open_span(manager, Kind.OPTIM, chunk, start, end, load=False)
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
        parts, copy = open_span(manager, kind, chunk, low, high, load=load, writable=modify)
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


@dataclass
class WholeChunk:
    """A whole host copy of a chunk opened by :func:`open_whole` (sharded plans)."""

    key: Key
    region: torch.Tensor  # this rank's home bytes (a host home or staging copy)
    copy: Copy | None  # the staging copy behind ``region``, if any
    whole: torch.Tensor  # the chunk's bytes, every shard


def open_whole(
    manager: ChunkManager,
    key: Key,
    *,
    load: bool = True,
    writable: bool = True,
    gather: bool = True,
) -> tuple[torch.Tensor, WholeChunk | Copy | None]:
    """``manager.open_host`` of the whole chunk (every rank's shard): collective when
    sharded, where ``load`` gathers it; pair with :func:`close_whole`.

    ``gather=False`` (not collective) loads only this rank's part of the whole
    chunk, the rest being zeros: enough for writes every rank makes alike, of
    which each keeps only its own shard (loading state it was given whole).
    """
    region, copy = manager.open_host(key, load=load, writable=writable)
    plan = manager.plan
    if not plan.sharded:
        return region, copy
    assert manager.collectives is not None
    whole = torch.zeros(whole_bytes(plan, key), dtype=torch.uint8)
    account = manager.transient_account
    account.add(whole.nbytes)
    if load and gather:
        # A unit's shards arrive in a buffer of their own (gather_whole), as large
        gathered = whole.nbytes if key[0] is Kind.OPTIM else 0
        account.add(gathered)
        try:
            gather_whole(plan, manager.collectives, key, region, whole)
        finally:
            account.sub(gathered)
    elif load:
        place_shard(plan, key, region, whole)
    return whole, WholeChunk(key, region, copy, whole)


def close_whole(
    manager: ChunkManager, handle: WholeChunk | Copy | None, *, modified: bool, keep: bool = False
) -> None:
    """Finish with :func:`open_whole` (``keep`` as ``close_host``); if ``modified`` each
    rank stores its own shard of the whole chunk (every rank must have written the
    same whole values)."""
    if not isinstance(handle, WholeChunk):
        manager.close_host(handle, modified=modified, keep=keep)
        return
    manager.transient_account.sub(handle.whole.nbytes)
    if modified:
        take_shard(manager.plan, handle.key, handle.whole, handle.region)
    manager.close_host(handle.copy, modified=modified, keep=keep)
