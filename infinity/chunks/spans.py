"""Spans: an oversize chunk's host-side traffic, in pieces of the normal chunk size.

A tensor larger than a chunk gets an oversize chunk (see ``chunks/layout.py``).
The device must hold it whole while a module computes with it, but nothing on
the host needs to: every NVMe-homed key of an oversize chunk is moved through
host staging as *spans*, consecutive element ranges ``[start, end)`` of at most
``layout.chunk_elems`` elements. A span key names the same elements of every
part of its key (an optimizer unit's master and state slots), laid out part
after part in its staging slot, so a span of a unit looks exactly like the unit
of a chunk of ``end - start`` elements. Host staging is thus bounded by the
normal chunk size whatever the largest tensor is. The planner stages an
oversize chunk whole (``Plan.span_elems``) only when whole slots cost no extra
NVMe bytes per step.

Span boundaries and oversize capacities are multiples of the chunk
optimizer's ``span_granule`` (the I/O granule of every part, int8 block scales
included), so every piece's byte range stays O_DIRECT-aligned.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from infinity.core.names import Key, Kind
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import StateFormat, unit_ranges


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
