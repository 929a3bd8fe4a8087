"""Chunk layout: which tensor lives in which chunk at which offset.

A pure function of tensor sizes (no allocation), so the planner, the chunk-size
search and ``infinity plan`` can run it on a model that has no memory yet.

Tensors are packed in the given order (first-use order once a trace exists,
registration order before) into chunks of ``chunk_elems`` elements. A tensor
larger than a chunk gets an *oversize* chunk of its own, rounded up to the I/O
alignment, never an error. Trainable and frozen tensors never share a chunk:
frozen chunks have no gradient and no optimizer state.

``chunk_size="auto"`` (:func:`search_chunk_size`): the chunk size that wastes least
for a model's tensors. Waste is capacity no tensor uses (alignment gaps, chunk
tails, the rounding of oversize chunks). Candidates are a geometric grid, the exact
sizes of the largest tensors, and the sizes of *spans*: runs of consecutive module
groups as the layout packs them (a transformer block's attention weights together,
say). A chunk that holds a span exactly leaves no tail, and in a model built of
repeated blocks the same span repeats in every block; the grid alone misses such
sizes (a 7B GPT wasted 9.8% at the grid's best, 1% at its attention span). The
planner bounds the search by what the budgets can hold."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from infinity._native.io import ALIGNMENT as IO_ALIGNMENT
from infinity.core.plan import ChunkLayout, ChunkSpec, TensorInfo, TensorSlot
from infinity.utils.sizes import align_up

# Tensors start on 64-byte boundaries inside a chunk so SIMD loads of the
# optimizer kernel stay aligned; the gap costs at most 31 elements per tensor.
TENSOR_ALIGN_BYTES = 64


def chunk_alignment_elems(element_size: int) -> int:
    """Capacity granularity: every kind's chunk bytes stay a multiple of the I/O alignment.

    See NOTE [O_DIRECT alignment] (docs/NOTES.md).
    """
    return IO_ALIGNMENT // element_size


def tensor_alignment_elems(element_size: int) -> int:
    """Where tensors start inside a chunk: every ``TENSOR_ALIGN_BYTES``."""
    return max(1, TENSOR_ALIGN_BYTES // element_size)


def _group_sizes(tensors: Sequence[TensorInfo], align: int) -> dict[tuple[int, bool], int]:
    """Aligned elements each (module group, stream) needs when packed together."""
    sizes: dict[tuple[int, bool], int] = {}
    for info in tensors:
        key = (info.group, info.trainable)
        sizes[key] = align_up(sizes.get(key, 0), align) + info.numel
    return sizes


def build_layout(
    tensors: Sequence[TensorInfo],
    chunk_elems: int,
    element_size: int,
    *,
    tensor_align: int = 1,
    oversize_align: int = 1,
) -> ChunkLayout:
    """Pack ``tensors`` in order into chunks of ``chunk_elems`` elements.

    Trainable and frozen tensors go to separate chunk streams (each keeps the
    given order); a tensor that does not fit an empty chunk gets an oversize
    chunk of its own. Tensors start on multiples of ``TENSOR_ALIGN_BYTES`` and of
    ``tensor_align`` elements (the optimizer's: int8 states start on a
    quantisation block, so no block holds two tensors). Oversize capacities are
    multiples of ``oversize_align`` elements too when a normal chunk holds at least
    that many (the optimizer's span granule: such a chunk may then be staged in
    spans, see ``chunks/pools.py``; below it, the planner never splits).
    """
    granule = chunk_alignment_elems(element_size)
    if chunk_elems <= 0 or chunk_elems % granule:
        raise ValueError(
            f"chunk_elems={chunk_elems} must be a positive multiple of {granule} "
            f"({IO_ALIGNMENT} bytes of {element_size}-byte elements)"
        )
    align = math.lcm(tensor_alignment_elems(element_size), tensor_align)
    oversize_granule = math.lcm(granule, oversize_align if chunk_elems >= oversize_align else 1)
    # Open chunk per stream: (trainable) -> list of (index, offset, numel, shape)
    open_chunk: dict[bool, list[tuple[int, int, int, tuple[int, ...]]]] = {True: [], False: []}
    open_fill: dict[bool, int] = {True: 0, False: 0}
    closed: list[tuple[bool, bool, int, list[tuple[int, int, int, tuple[int, ...]]]]] = []

    def close(trainable: bool) -> None:
        if open_chunk[trainable]:
            closed.append((trainable, False, chunk_elems, open_chunk[trainable]))
            open_chunk[trainable] = []
            open_fill[trainable] = 0

    group_size = _group_sizes(tensors, align)
    for i, info in enumerate(tensors):
        numel = info.numel
        first_of_group = info.group >= 0 and (i == 0 or tensors[i - 1].group != info.group)
        if first_of_group:
            # A module whose weight and bias straddle two chunks needs both
            # resident at once; start a fresh chunk when that keeps it whole.
            need = group_size[(info.group, info.trainable)]
            fill = align_up(open_fill[info.trainable], align)
            if fill and fill + need > chunk_elems >= need:
                close(info.trainable)
        if numel == 0:
            # Empty tensors take no bytes; they sit at offset 0 of the
            # current chunk so every tensor has a slot.
            open_chunk[info.trainable].append((i, open_fill[info.trainable], 0, info.shape))
            continue
        if numel > chunk_elems:
            closed.append(
                (
                    info.trainable,
                    True,
                    align_up(numel, oversize_granule),
                    [(i, 0, numel, info.shape)],
                )
            )
            continue
        start = align_up(open_fill[info.trainable], align)
        if start + numel > chunk_elems:
            close(info.trainable)
            start = 0
        open_chunk[info.trainable].append((i, start, numel, info.shape))
        open_fill[info.trainable] = start + numel
    close(True)
    close(False)

    # Stable numbering: chunks ordered by their first tensor's position, so the
    # chunk order follows the tensor order (the access order once traced).
    closed.sort(key=lambda c: c[3][0][0])
    chunks: list[ChunkSpec] = []
    slots: list[TensorSlot | None] = [None] * len(tensors)
    for ci, (trainable, oversize, capacity, members) in enumerate(closed):
        specs = []
        for ti, offset, numel, shape in members:
            slot = TensorSlot(index=ti, chunk=ci, offset=offset, numel=numel, shape=shape)
            slots[ti] = slot
            specs.append(slot)
        chunks.append(
            ChunkSpec(
                index=ci,
                capacity=capacity,
                slots=tuple(specs),
                trainable=trainable,
                oversize=oversize,
            )
        )
    assert all(s is not None for s in slots)
    return ChunkLayout(
        chunk_elems=chunk_elems,
        element_size=element_size,
        chunks=tuple(chunks),
        slots=tuple(s for s in slots if s is not None),
    )


MIN_AUTO_CHUNK_BYTES = 1 << 20
MIN_AUTO_CHUNKS = 32
_GRID_STEPS_PER_DOUBLING = 8
_EXACT_CANDIDATES = 16
_SPAN_CANDIDATES = 32
_SPAN_MAX_GROUPS = 32
# A span may exceed the granularity bound (model / MIN_AUTO_CHUNKS) by
# half: a model whose blocks are a little larger than 1/32 of it otherwise
# gets chunks that split every block (GPT 8x512: 18% waste and 16 oversize
# chunks at the bound, 3% and none at its 4 MiB span).
_SPAN_STRETCH = 1.5


def chunk_size_candidates(
    tensors: Sequence[TensorInfo], element_size: int, min_bytes: int, max_bytes: int
) -> list[int]:
    """Grid and exact-tensor candidate sizes in elements, ascending, within
    ``[min_bytes, max_bytes]``."""
    granule = chunk_alignment_elems(element_size)
    lo = max(granule, align_up(min_bytes // element_size, granule))
    hi = max(lo, max_bytes // element_size // granule * granule)
    candidates = set()
    size = float(lo)
    while size <= hi:
        candidates.add(align_up(int(size), granule))
        size *= 2 ** (1 / _GRID_STEPS_PER_DOUBLING)
    candidates.add(hi)
    largest = sorted({t.numel for t in tensors}, reverse=True)[:_EXACT_CANDIDATES]
    for numel in largest:
        exact = align_up(numel, granule)
        if lo <= exact <= hi:
            candidates.add(exact)
    return sorted(c for c in candidates if lo <= c <= hi)


def _group_runs(tensors: Sequence[TensorInfo], align: int) -> dict[bool, list[int]]:
    """Per stream (trainable or frozen), the packed elements of each run of one
    module group, in order (an ungrouped tensor is a run of its own)."""
    runs: dict[bool, list[int]] = {True: [], False: []}
    last_group: dict[bool, int] = {True: -1, False: -1}
    for info in tensors:
        stream = runs[info.trainable]
        if info.group >= 0 and info.group == last_group[info.trainable]:
            stream[-1] = align_up(stream[-1], align) + info.numel
        else:
            stream.append(info.numel)
        last_group[info.trainable] = info.group
    return runs


def span_candidates(
    tensors: Sequence[TensorInfo], element_size: int, min_bytes: int, max_bytes: int
) -> list[int]:
    """The most frequent span sizes in elements, ascending, within ``[min_bytes, max_bytes]``.

    A span is a run of up to ``_SPAN_MAX_GROUPS`` consecutive module groups of
    one stream, packed with the layout's alignment and rounded up to the chunk
    granule.
    """
    granule = chunk_alignment_elems(element_size)
    align = tensor_alignment_elems(element_size)
    lo = align_up(max(1, min_bytes // element_size), granule)
    hi = max_bytes // element_size
    counts: Counter[int] = Counter()
    for runs in _group_runs(tensors, align).values():
        for start in range(len(runs)):
            filled = 0
            for numel in runs[start : start + _SPAN_MAX_GROUPS]:
                filled = align_up(filled, align) + numel
                size = align_up(filled, granule)
                if size > hi:
                    break
                if size >= lo:
                    counts[size] += 1
    # most frequent first, larger first among equals (a repeated block wins)
    ranked = sorted(counts, key=lambda size: (-counts[size], -size))
    return sorted(ranked[:_SPAN_CANDIDATES])


def chunk_cap(tensors: Sequence[TensorInfo], element_size: int, cap_bytes: int) -> int:
    """The largest auto chunk size in bytes: ``cap_bytes``, raised to hold the
    largest module group (with a span's headroom) when the tensors above
    ``cap_bytes`` are over a quarter of the model.

    Then most matrices would be oversize at any allowed size, the
    oversize rule of :func:`search_chunk_size` excludes nothing, and the
    search drifts to tiny chunks (a 70B GPT's 512 MiB matrices against a
    256 MiB cap: 1.8 MiB chunks, 322 of 331 oversize). A model with one big
    embedding keeps the cap: raising it would only buy larger staging.
    """
    total = sum(t.numel for t in tensors)
    above = sum(t.numel for t in tensors if t.numel * element_size > cap_bytes)
    if above * 4 <= total:
        return cap_bytes
    align = tensor_alignment_elems(element_size)
    largest = max(n for runs in _group_runs(tensors, align).values() for n in runs)
    return max(cap_bytes, int(largest * element_size * _SPAN_STRETCH))


def _oversize_elems(layout: ChunkLayout) -> int:
    return sum(c.capacity for c in layout.chunks if c.oversize)


def search_chunk_size(
    tensors: Sequence[TensorInfo],
    element_size: int,
    *,
    max_bytes: int,
    min_bytes: int = MIN_AUTO_CHUNK_BYTES,
    min_chunks: int = MIN_AUTO_CHUNKS,
) -> int:
    """Return the chunk size in elements that wastes least; ties go to the larger size.

    Bounds: at most ``max_bytes`` (the planner derives it from the budgets) and
    small enough that the model spans about ``min_chunks`` chunks (placement
    across tiers and prefetch need granularity; span sizes may stretch this
    by half). Waste alone would favour tiny chunks with every tensor in an
    oversize chunk of its own (no waste, and no point in chunks), so a
    candidate may put at most 10% more of the model into oversize chunks than
    the largest candidate does. A model smaller than ``min_bytes`` gets one
    chunk that fits it.
    """
    total = sum(t.numel for t in tensors)
    granule = chunk_alignment_elems(element_size)
    if total * element_size <= min_bytes:
        return max(granule, align_up(total, granule))
    bound = max(min_bytes, min(max_bytes, total * element_size // min_chunks))
    stretched = max(bound, min(max_bytes, int(bound * _SPAN_STRETCH)))
    candidates = sorted(
        set(chunk_size_candidates(tensors, element_size, min_bytes, bound))
        | set(span_candidates(tensors, element_size, min_bytes, stretched))
    )
    layouts = {elems: build_layout(tensors, elems, element_size) for elems in candidates}
    allowed = _oversize_elems(layouts[candidates[-1]]) + total // 10
    best: tuple[int, int] | None = None  # (waste, -size)
    for elems, layout in layouts.items():
        if _oversize_elems(layout) > allowed:
            continue
        key = (layout.wasted_elems(), -elems)
        if best is None or key < best:
            best = key
    assert best is not None
    return -best[1]
