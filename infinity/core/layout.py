"""The chunk layout's data types: which tensor lives in which chunk at which offset.

Built by :func:`infinity.chunks.layout.build_layout`; read by every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class TensorInfo:
    """What the layout needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    group: int = -1  # tensors of one module share a group; kept in one chunk when possible

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives: chunk ``chunk``, elements ``[offset, offset + numel)``."""

    index: int  # position in the layout's tensor list
    chunk: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: its capacity in elements and the tensors packed in it."""

    index: int
    capacity: int  # elements; a multiple of chunk_alignment_elems
    slots: tuple[TensorSlot, ...]
    trainable: bool
    oversize: bool

    @property
    def used(self) -> int:
        """Elements up to the end of the last tensor."""
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    def nbytes(self, element_size: int) -> int:
        """Bytes of this chunk for a kind whose elements have ``element_size`` bytes."""
        return self.capacity * element_size


@dataclass(frozen=True)
class ChunkLayout:
    """The packing of all tensors into chunks, for one compute element size."""

    chunk_elems: int
    element_size: int
    chunks: tuple[ChunkSpec, ...]
    slots: tuple[TensorSlot, ...]  # indexed like the input tensors

    @property
    def num_chunks(self) -> int:
        """Number of chunks (normal and oversize)."""
        return len(self.chunks)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a normal chunk in the compute dtype."""
        return self.chunk_elems * self.element_size

    def wasted_elems(self) -> int:
        """Capacity not covered by tensors (alignment gaps and chunk tails)."""
        used = sum(s.numel for s in self.slots)
        return sum(c.capacity for c in self.chunks) - used

    def group_by_chunk(
        self, items: Iterable[T], tensor_index: Callable[[T], int]
    ) -> dict[int, list[T]]:
        """``items`` grouped by the chunk holding their tensor (``tensor_index(item)``
        is its position in :attr:`slots`), chunks and items in first-seen order."""
        grouped: dict[int, list[T]] = {}
        for item in items:
            grouped.setdefault(self.slots[tensor_index(item)].chunk, []).append(item)
        return grouped
