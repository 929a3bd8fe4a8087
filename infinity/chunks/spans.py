"""Spans: an oversize chunk's host-side traffic, in pieces of the normal chunk size.

A tensor larger than a chunk gets an oversize chunk (see ``chunks/layout.py``).
The device must hold it whole while a module computes with it, but nothing on
the host needs to: every NVMe-homed key of an oversize chunk is moved through
host staging as *spans*, consecutive element ranges ``[start, end)`` of at most
``layout.chunk_elems`` elements. A span key names the same elements of every
part of its key (an optimizer unit's master and state slots), laid out part
after part in its staging slot, so a span of a unit looks exactly like the unit
of a chunk of ``end - start`` elements. Host staging is thus bounded by the
normal chunk size whatever the largest tensor is. The planner splits only when
it must (``Plan.span_elems``): with room for whole staging slots, an oversize
chunk is staged whole as before.

NOTE: span boundaries are multiples of the normal chunk capacity, itself a
multiple of the I/O granule for every kind (``chunk_alignment_elems``), so every
part's byte range stays O_DIRECT-aligned.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from infinity.core.names import Key, Kind
from infinity.core.plan import Plan


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
    return plan.layout.chunks[chunk].capacity > plan.span_elems


def span_ranges(plan: Plan, chunk: int) -> list[tuple[int, int]]:
    """The element ranges of chunk ``chunk``'s spans (one range for a normal chunk)."""
    capacity = plan.layout.chunks[chunk].capacity
    step = plan.span_elems if is_split(plan, chunk) else capacity
    return [(start, min(start + step, capacity)) for start in range(0, capacity, step)]


def part_ranges(key: SpanKey, capacity: int, home_bytes: int) -> list[tuple[int, int]]:
    """(byte offset in the home, bytes) of each part of a span, in part order.

    A home holds ``home_bytes // (capacity * element bytes)`` equally long parts
    of ``capacity`` elements each (one for parameters and gradients; the master
    and the state slots for an optimizer unit).
    """
    element = home_bytes // capacity
    width = key.end - key.start
    parts = max(1, element // _part_element_bytes(key.kind, element))
    per_part = element // parts
    return [
        (k * capacity * per_part + key.start * per_part, width * per_part) for k in range(parts)
    ]


def _part_element_bytes(kind: Kind, element: int) -> int:
    # NOTE: an optimizer unit's parts are fp32; a parameter or gradient home is
    # one part of the compute dtype.
    return 4 if kind is Kind.OPTIM else element


def span_nbytes(key: SpanKey, capacity: int, home_bytes: int) -> int:
    """Bytes of a span's staging copy: its slice of every part."""
    return sum(n for _offset, n in part_ranges(key, capacity, home_bytes))


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
