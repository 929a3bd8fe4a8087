"""Slab pools: fixed-size slots carved out of one allocation made up front, and the
spans an oversize chunk's host traffic is cut into to fit them.

No allocation happens on the hot path and nothing fragments: a slot is a view
of the slab, taken from and returned to a free list.

Exact byte accounting per tier (:class:`TierAccount`), and traffic/wait
counters: only the chunk manager changes these, always in the same place it
takes or returns a slot, so the totals are right by construction.

Two-stage transfers (:class:`ChainedTransfer`): NVMe -> host staging, then host
-> device. The second stage may start only when the first has landed. Rather
than a thread per transfer, the chain advances whenever anyone looks at it (a
``done()`` poll from the prefetcher or an eviction check) or waits on it.
Several transfers seen as one: :class:`AllOf`.

Spans: a tensor larger than a chunk gets an oversize chunk (see
``chunks/layout.py``). The device must hold it whole while a module computes
with it, but nothing on the host needs to: every NVMe-homed key of an oversize
chunk is moved through host staging as *spans*, consecutive element ranges
``[start, end)`` of at most ``layout.chunk_elems`` elements. A span key
(:class:`SpanKey`) names the same elements of every part of its key (an
optimizer unit's master and state slots), laid out part after part in its
staging slot, so a span of a unit looks exactly like the unit of a chunk of
``end - start`` elements. Host staging is thus bounded by the normal chunk size
whatever the largest tensor is. The planner stages an oversize chunk whole
(``Plan.span_elems``) only when whole slots cost no extra NVMe bytes per step.

Span boundaries and oversize capacities are multiples of the chunk
optimizer's ``span_granule`` (the I/O granule of every part, int8 block scales
included), so every piece's byte range stays O_DIRECT-aligned.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

import torch

from infinity.core.names import Key, Kind
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import StateFormat, unit_ranges


@dataclass(eq=False)
class Slot:
    """One slot of a pool: ``tensor`` is a uint8 view of ``nbytes``."""

    # Weak: the pool holds its slots, and a cycle would keep the slab alive after the
    # engine until a garbage collection (NOTE [the model owns its engine]).
    pool_ref: weakref.ref[SlabPool]
    index: int
    tensor: torch.Tensor

    @property
    def pool(self) -> SlabPool:
        """The pool the slot belongs to."""
        pool = self.pool_ref()
        assert pool is not None, "a slot outlived its pool"
        return pool

    @property
    def nbytes(self) -> int:
        """Size of the slot."""
        return self.tensor.numel()


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
        me = weakref.ref(self)
        self._slots = [
            Slot(me, i, self.slab[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(count)
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
    # in_hook's state: its nesting depth, the outermost hook's start and stall.
    _depth: int = field(default=0, init=False, repr=False)
    _start: float = field(default=0.0, init=False, repr=False)
    _stall: AbstractContextManager[None] | None = field(default=None, init=False, repr=False)

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
        outermost counts. The counters are their own timer: around every hook call, a
        thousand a step, no generator, no allocation, and no object holding them (a
        reference cycle: NOTE [the model owns its engine])."""
        return self

    def __enter__(self) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
            self._stall = self.stall()
            self._stall.__enter__()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            assert self._stall is not None
            self._stall.__exit__(None, None, None)
            self.hook_seconds += time.perf_counter() - self._start

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


class SpanKey(NamedTuple):
    """Elements ``[start, end)`` of every part of the home of ``(kind, chunk)``."""

    kind: Kind
    chunk: int
    start: int
    end: int

    @property
    def base(self) -> Key:
        """The (kind, chunk) this span belongs to."""
        return (self.kind, self.chunk)


def span_key(kind: Kind, chunk: int, start: int, end: int) -> Key:
    """A span key, typed as a :data:`Key` (its ``[0]`` and ``[1]`` are kind and chunk,
    so every cache and accounting path treats it as one)."""
    return cast(Key, SpanKey(kind, chunk, start, end))


def base_key(key: Key) -> Key:
    """``key`` itself, or the (kind, chunk) a span key belongs to."""
    return key.base if isinstance(key, SpanKey) else key


def is_split(plan: Plan, chunk: int) -> bool:
    """Chunk ``chunk`` is larger than the plan's span: its staged traffic goes in spans."""
    return plan.home_elems(chunk) > plan.span_elems


def first_span(plan: Plan, key: Key) -> Key:
    """``key``, or its first span if it is an oversize key (not a span already)."""
    if isinstance(key, SpanKey) or not is_split(plan, key[1]):
        return key
    start, end = span_ranges(plan, key[1])[0]
    return span_key(key[0], key[1], start, end)


def span_ranges(plan: Plan, chunk: int) -> list[tuple[int, int]]:
    """The element ranges of chunk ``chunk``'s spans (one range for a normal chunk)."""
    capacity = plan.layout.chunks[chunk].capacity
    step = plan.span_elems if is_split(plan, chunk) else capacity
    return [(start, min(start + step, capacity)) for start in range(0, capacity, step)]


def transfer_keys(plan: Plan, kind: Kind, chunk: int) -> list[tuple[Key, int, int]]:
    """The keys ``(kind, chunk)``'s home is staged under, with their element ranges:
    the chunk's own key, or one span key per span of an oversize chunk. A read
    under the key its bytes were written under waits for that write in flight."""
    ranges = span_ranges(plan, chunk)
    if len(ranges) == 1:  # not split (a split chunk has two spans or more)
        return [((kind, chunk), *ranges[0])]
    return [(span_key(kind, chunk, a, b), a, b) for a, b in ranges]


def part_ranges(plan: Plan, key: SpanKey) -> list[tuple[int, int]]:
    """(byte offset in the home, bytes) of each contiguous piece of a span, in home order.

    A parameter or gradient span is one piece. An optimizer unit's span has one
    piece per part: the fp32 master (if any), then each state slot's values and,
    for int8, its block scales (``ChunkOptimizer.tensor_ranges``). Back to back,
    the pieces are laid out exactly as the unit of a chunk of ``end - start``
    elements: a staged span is such a unit.
    """
    width = key.end - key.start
    if key.kind is not Kind.OPTIM:
        size = plan.element_size
        return [(key.start * size, width * size)]
    capacity = plan.layout.chunks[key.chunk].capacity
    fmt = StateFormat(plan.state_dtype)
    ranges = unit_ranges(fmt, len(plan.state_slots), capacity, plan.has_master, key.start, width)
    return [r for r in ranges if r[1]]


def span_nbytes(plan: Plan, key: SpanKey) -> int:
    """Bytes of a span's staging copy: its slice of every part."""
    return sum(n for _offset, n in part_ranges(plan, key))


class AllOf:
    """Several transfers seen as one: done when all are, ``wait`` raises the first error."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list) -> None:
        self._parts = parts

    def done(self) -> bool:
        """Every part has completed."""
        return all(p.done() for p in self._parts)

    def wait(self) -> None:
        """Wait for every part, then raise the first failure, if any."""
        error: BaseException | None = None
        for p in self._parts:
            try:
                p.wait()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
