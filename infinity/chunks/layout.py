"""Chunk layout: which tensor lives in which chunk at which offset.

A pure function of tensor sizes (no allocation), so the planner, the chunk-size
search and ``infinity plan`` can run it on a model that has no memory yet.

Tensors are packed in the given order (first-use order once a trace exists,
registration order before) into chunks of ``chunk_elems`` elements. A tensor
larger than a chunk gets an *oversize* chunk of its own, rounded up to the I/O
alignment, never an error. Trainable and frozen tensors never share a chunk:
frozen chunks have no gradient and no optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from infinity._native.io import ALIGNMENT as IO_ALIGNMENT
from infinity.core.layout import ChunkLayout, ChunkSpec, TensorInfo, TensorSlot
from infinity.utils.sizes import align_up

# NOTE: tensors start on 64-byte boundaries inside a chunk so SIMD loads of the
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
    spans, see ``chunks/spans.py``; below it, the planner never splits).
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
            # NOTE: a module whose weight and bias straddle two chunks needs both
            # resident at once; start a fresh chunk when that keeps it whole.
            need = group_size[(info.group, info.trainable)]
            fill = align_up(open_fill[info.trainable], align)
            if fill and fill + need > chunk_elems >= need:
                close(info.trainable)
        if numel == 0:
            # NOTE: empty tensors take no bytes; they sit at offset 0 of the
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
