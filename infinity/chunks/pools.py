"""Slab pools: fixed-size slots carved out of one allocation made up front.

No allocation happens on the hot path and nothing fragments: a slot is a view
of the slab, taken from and returned to a free list. Byte accounting is done
by the manager (:mod:`infinity.chunks.accounting`), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Slot:
    """One slot of a pool: ``tensor`` is a uint8 view of ``nbytes``."""

    pool: SlabPool
    index: int
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Size of the slot."""
        return self.pool.slot_bytes


class PoolExhausted(RuntimeError):
    """No free slot and nothing that may be evicted."""


class SlabPool:
    """``count`` slots of ``slot_bytes`` in one allocation from ``allocate``."""

    def __init__(
        self,
        tier: str,
        slot_bytes: int,
        count: int,
        allocate: Callable[[int], torch.Tensor],
    ) -> None:
        if slot_bytes <= 0 or count < 0:
            raise ValueError(f"bad pool shape: {count} slots of {slot_bytes} bytes")
        self.tier = tier
        self.slot_bytes = slot_bytes
        self.count = count
        self.slab = allocate(slot_bytes * count) if count else torch.empty(0, dtype=torch.uint8)
        self._slots = [
            Slot(self, i, self.slab[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(count)
        ]
        # LIFO free list: a recently freed slot is likely still in cache.
        self._free = list(reversed(self._slots))

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated for the whole pool."""
        return self.slot_bytes * self.count

    def try_take(self) -> Slot | None:
        """A free slot, or ``None`` if all are in use."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: Slot) -> None:
        """Return ``slot`` to the free list."""
        if slot.pool is not self:
            raise ValueError("slot returned to a pool it does not belong to")
        self._free.append(slot)


class Arena:
    """A single allocation split into fixed regions (permanent homes of chunks)."""

    def __init__(
        self, tier: str, sizes: list[int], allocate: Callable[[int], torch.Tensor]
    ) -> None:
        self.tier = tier
        total = sum(sizes)
        self.slab = allocate(total) if total else torch.empty(0, dtype=torch.uint8)
        self.regions: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            self.regions.append(self.slab[offset : offset + size])
            offset += size
        self.reserved_bytes = total
