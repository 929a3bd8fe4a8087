"""``chunk_size="auto"``: the chunk size that wastes least for a model's tensors.

Waste is capacity no tensor uses (alignment gaps, chunk tails, the rounding of
oversize chunks). Candidates are a geometric grid plus the exact sizes of the
largest tensors (a chunk that fits a big tensor exactly often wastes least).
The planner bounds the search by what the budgets can hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from infinity.chunks.layout import TensorInfo, build_layout, chunk_alignment_elems

MIN_AUTO_CHUNK_BYTES = 1 << 20
MIN_AUTO_CHUNKS = 32
_GRID_STEPS_PER_DOUBLING = 8
_EXACT_CANDIDATES = 16


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def chunk_size_candidates(
    tensors: Sequence[TensorInfo], element_size: int, min_bytes: int, max_bytes: int
) -> list[int]:
    """Candidate chunk sizes in elements, ascending, all within ``[min_bytes, max_bytes]``."""
    granule = chunk_alignment_elems(element_size)
    lo = max(granule, _round_up(min_bytes // element_size, granule))
    hi = max(lo, max_bytes // element_size // granule * granule)
    candidates = set()
    size = float(lo)
    while size <= hi:
        candidates.add(_round_up(int(size), granule))
        size *= 2 ** (1 / _GRID_STEPS_PER_DOUBLING)
    candidates.add(hi)
    largest = sorted({t.numel for t in tensors}, reverse=True)[:_EXACT_CANDIDATES]
    for numel in largest:
        exact = _round_up(numel, granule)
        if lo <= exact <= hi:
            candidates.add(exact)
    return sorted(c for c in candidates if lo <= c <= hi)


def _oversize_elems(layout) -> int:
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
    across tiers and prefetch need granularity). Waste alone would favour tiny
    chunks with every tensor in an oversize chunk of its own (no waste, and no
    point in chunks), so a candidate may put at most 10% more of the model into
    oversize chunks than the largest candidate does. A model smaller than
    ``min_bytes`` gets one chunk that fits it.
    """
    total = sum(t.numel for t in tensors)
    granule = chunk_alignment_elems(element_size)
    if total * element_size <= min_bytes:
        return max(granule, _round_up(total, granule))
    max_bytes = max(min_bytes, min(max_bytes, total * element_size // min_chunks))
    candidates = chunk_size_candidates(tensors, element_size, min_bytes, max_bytes)
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
