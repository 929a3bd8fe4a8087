"""Slab pools: fixed-size slots carved out of one allocation made up front.

No allocation happens on the hot path and nothing fragments: a slot is a view
of the slab, taken from and returned to a free list.

Exact byte accounting per tier (:class:`TierAccount`), and traffic/wait
counters: only the chunk manager changes these, always in the same place it
takes or returns a slot, so the totals are right by construction.

Two-stage transfers (:class:`ChainedTransfer`): NVMe -> host staging, then host
-> device. The second stage may start only when the first has landed. Rather
than a thread per transfer, the chain advances whenever anyone looks at it (a
``done()`` poll from the prefetcher or an eviction check) or waits on it.

"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

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


@dataclass
class TierAccount:
    """Bytes of chunk data resident in one tier, with the peak since reset."""

    tier: str
    budget: int | None
    reserved: int = 0  # bytes of slabs allocated for the tier
    used: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        """Account ``nbytes`` more in use."""
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used
        if self.budget is not None and self.used > self.budget:
            raise AssertionError(
                f"{self.tier} tier holds {self.used} bytes, above its budget {self.budget}"
            )

    def sub(self, nbytes: int) -> None:
        """Account ``nbytes`` fewer in use."""
        self.used -= nbytes
        if self.used < 0:
            raise AssertionError(f"{self.tier} tier accounting went negative ({self.used})")


@dataclass
class Traffic:
    """Bytes moved per link and seconds spent waiting per tier."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0
    wait_seconds: dict[str, float] = field(default_factory=lambda: {"device": 0.0, "nvme": 0.0})
    # The swap file's I/O engine busy clock (IOEngine.busy_seconds), if there is one.
    nvme_busy_clock: Callable[[], float] | None = field(default=None, repr=False)
    # Host time in the optimizer's chunk updates, their waits for data excluded.
    host_optimizer_seconds: float = 0.0
    # Host time in the engine's hooks (fetches, releases, gradients), waits included.
    hook_seconds: float = 0.0
    # Brackets a wait in which the device may idle (the backend's ``stall``:
    # NOTE [the step's bound]).
    stall: Callable[[], AbstractContextManager[None]] = field(default=nullcontext, repr=False)
    _hook_timer: _HookTimer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._hook_timer = _HookTimer(self)

    def snapshot(self) -> dict[str, float]:
        """A flat copy of the counters. ``nvme_busy_seconds``: the time the swap
        file's I/O engine had a transfer in flight (0 without NVMe); against a
        step's wall time it is how long the disk worked for that step."""
        out: dict[str, float] = {
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "nvme_read_bytes": self.nvme_read_bytes,
            "nvme_write_bytes": self.nvme_write_bytes,
            "nvme_busy_seconds": self.nvme_busy_clock() if self.nvme_busy_clock else 0.0,
            "host_optimizer_seconds": self.host_optimizer_seconds,
            "hook_seconds": self.hook_seconds,
        }
        for tier, seconds in self.wait_seconds.items():
            out[f"wait_{tier}_seconds"] = seconds
        return out

    def add(self, other: Traffic) -> None:
        """Count ``other``'s bytes and waits here too (a manager replacing another's:
        totals stay totals since ``offload``)."""
        self.h2d_bytes += other.h2d_bytes
        self.d2h_bytes += other.d2h_bytes
        self.nvme_read_bytes += other.nvme_read_bytes
        self.nvme_write_bytes += other.nvme_write_bytes
        self.host_optimizer_seconds += other.host_optimizer_seconds
        self.hook_seconds += other.hook_seconds
        for tier, seconds in other.wait_seconds.items():
            self.wait_seconds[tier] = self.wait_seconds.get(tier, 0.0) + seconds

    @contextmanager
    def waiting(self, tier: str) -> Iterator[None]:
        """Time a blocking wait on ``tier``."""
        start = time.perf_counter()
        try:
            with self.stall():
                yield
        finally:
            self.wait_seconds[tier] = self.wait_seconds.get(tier, 0.0) + time.perf_counter() - start

    def in_hook(self) -> AbstractContextManager[None]:
        """Time one of the engine's hooks: host work in which the device may idle
        (NOTE [the step's bound]). Hooks nest (a fetch inside a gradient's); the
        outermost counts."""
        return self._hook_timer

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Time a host update of optimizer states (its waits counted apart)."""
        start, waited = time.perf_counter(), sum(self.wait_seconds.values())
        try:
            with self.stall():
                yield
        finally:
            waited = sum(self.wait_seconds.values()) - waited
            self.host_optimizer_seconds += time.perf_counter() - start - waited


class _HookTimer:
    """``with traffic.in_hook():`` — one reusable object (around every hook call,
    a thousand a step: no generator, no allocation)."""

    __slots__ = ("_depth", "_stall", "_start", "_traffic")

    def __init__(self, traffic: Traffic) -> None:
        self._traffic = traffic
        self._depth = 0
        self._start = 0.0
        self._stall: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
            self._stall = self._traffic.stall()
            self._stall.__enter__()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            assert self._stall is not None
            self._stall.__exit__(None, None, None)
            self._traffic.hook_seconds += time.perf_counter() - self._start


class Pending(Protocol):
    """Anything in flight on a slot: a device copy or an NVMe request."""

    def wait(self) -> object: ...
    def done(self) -> bool: ...


class ChainedTransfer:
    """``first`` (an NVMe read, or ``None`` if the data is already on the host),
    then ``start()`` (the host -> device copy)."""

    __slots__ = ("_first", "_second", "_start")

    def __init__(self, first: Pending | None, start: Callable[[], Pending]) -> None:
        self._first = first
        self._start = start
        self._second: Pending | None = None
        if first is None:
            self._second = start()
        else:
            self._advance()

    def _advance(self) -> None:
        if self._second is None and self._first is not None and self._first.done():
            self._first.wait()  # surfaces a failed read here, with its path and errno
            self._second = self._start()

    @property
    def started(self) -> bool:
        """The second stage has been issued."""
        self._advance()
        return self._second is not None

    def done(self) -> bool:
        """Both stages complete (advances the chain if the first just finished)."""
        self._advance()
        return self._second is not None and self._second.done()

    def wait(self) -> None:
        """Wait for the read, issue the copy if needed, wait for the copy."""
        if self._second is None:
            assert self._first is not None
            self._first.wait()
            self._second = self._start()
        self._second.wait()

    def wait_for_compute(self) -> None:
        """Like :meth:`wait`, but on CUDA only orders the compute stream after the copy."""
        if self._second is None:
            assert self._first is not None
            self._first.wait()
            self._second = self._start()
        self._second.wait_for_compute()  # type: ignore[attr-defined]
