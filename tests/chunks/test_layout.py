"""Chunk layout and chunk-size search: pure functions checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from infinity.chunks.chunk_size import search_chunk_size
from infinity.chunks.layout import IO_ALIGNMENT, TensorInfo, build_layout


def _tensors(sizes, trainable=None):
    trainable = trainable or [True] * len(sizes)
    pairs = zip(sizes, trainable, strict=True)
    return [TensorInfo(f"t{i}", (n,), t) for i, (n, t) in enumerate(pairs)]


def _check_invariants(tensors, layout, element_size):
    # every tensor has exactly one slot, inside its chunk, no overlaps
    assert len(layout.slots) == len(tensors)
    for spec in layout.chunks:
        assert spec.capacity * element_size % IO_ALIGNMENT == 0
        spans = sorted((s.offset, s.offset + s.numel) for s in spec.slots if s.numel)
        for (_a0, a1), (b0, _) in itertools.pairwise(spans):
            assert a1 <= b0, "tensors overlap inside a chunk"
        for s in spec.slots:
            assert 0 <= s.offset and s.offset + s.numel <= spec.capacity
            assert tensors[s.index].trainable == spec.trainable
    for t, s in zip(tensors, layout.slots, strict=False):
        assert s.numel == t.numel and s.shape == t.shape


@pytest.mark.parametrize("element_size", [2, 4])
def test_random_layouts_hold_invariants(element_size):
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.choice([1, 7, 64, 1000, 5000, 70000]) for _ in range(rng.randint(1, 40))]
        trainable = [rng.random() < 0.8 for _ in sizes]
        tensors = _tensors(sizes, trainable)
        chunk = 16384 if element_size == 4 else 32768
        layout = build_layout(tensors, chunk, element_size)
        _check_invariants(tensors, layout, element_size)
        # oversize tensors get chunks of their own
        for spec in layout.chunks:
            if spec.oversize:
                assert len(spec.slots) == 1 and spec.slots[0].numel > chunk


def test_order_is_kept_within_each_stream():
    tensors = _tensors([10, 20, 30, 40], [True, False, True, False])
    layout = build_layout(tensors, 1024, 4)
    trainable_chunks = [c for c in layout.chunks if c.trainable]
    assert [s.index for s in trainable_chunks[0].slots] == [0, 2]
    assert all(not c.trainable for c in layout.chunks if c.slots[0].index in (1, 3))


def test_bad_chunk_size_is_rejected():
    with pytest.raises(ValueError, match="multiple of"):
        build_layout(_tensors([10]), 1000, 4)


def test_search_finds_the_least_waste_among_candidates():
    tensors = _tensors([3000, 3000, 3000, 500, 9000, 120])
    best = search_chunk_size(tensors, 4, max_bytes=1 << 16, min_bytes=4096, min_chunks=1)
    waste = build_layout(tensors, best, 4).wasted_elems()
    # brute force over every 4 KiB-aligned size that holds the largest tensor
    brute = min(
        build_layout(tensors, elems, 4).wasted_elems()
        for elems in range(9216, (1 << 16) // 4 + 1, 1024)
    )
    assert best >= 9000  # no oversize chunk when a chunk can hold every tensor
    assert waste <= brute
    assert best * 4 <= 1 << 16


def test_tiny_model_gets_one_chunk():
    tensors = _tensors([100, 200])
    elems = search_chunk_size(tensors, 2, max_bytes=1 << 20)
    assert build_layout(tensors, elems, 2).num_chunks == 1


def test_search_keeps_granularity_and_avoids_oversize_everything():
    # one big embedding and many layer matrices (GPT-like)
    tensors = _tensors([400_000] + [20_000] * 60)
    elems = search_chunk_size(tensors, 2, max_bytes=64 << 20, min_bytes=1 << 16)
    layout = build_layout(tensors, elems, 2)
    assert layout.num_chunks >= 16  # granularity for placement and prefetch
    oversize = [c for c in layout.chunks if c.oversize]
    assert len(oversize) <= 1  # only the embedding, not every matrix
