"""Chunk layout and chunk-size search: pure functions checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from infinity.chunks.layout import (
    IO_ALIGNMENT,
    TensorInfo,
    build_layout,
    chunk_cap,
    search_chunk_size,
)


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


def _gpt_blocks(layers: int, hidden: int) -> list[TensorInfo]:
    """Weight + bias groups of GPT blocks, in forward order, as the registry lists them."""
    shapes = [
        ((hidden,), (hidden,)),  # ln1
        ((3 * hidden, hidden), (3 * hidden,)),  # qkv
        ((hidden, hidden), (hidden,)),  # attention out
        ((hidden,), (hidden,)),  # ln2
        ((4 * hidden, hidden), (4 * hidden,)),  # fc
        ((hidden, 4 * hidden), (hidden,)),  # proj
    ]
    tensors, group = [], 0
    for layer in range(layers):
        for weight, bias in shapes:
            tensors.append(TensorInfo(f"l{layer}.g{group}.w", weight, True, group))
            tensors.append(TensorInfo(f"l{layer}.g{group}.b", bias, True, group))
            group += 1
    return tensors


@pytest.mark.parametrize(("layers", "hidden"), [(16, 128), (8, 192), (24, 96)])
def test_search_is_close_to_the_brute_force_best_on_repeated_blocks(layers, hidden):
    # Module groups (weight + bias) repeated per block: the least-waste size is
    # a span of a block (e.g. its attention weights and biases together), which
    # a geometric grid of sizes misses.
    tensors = _gpt_blocks(layers, hidden)
    total = sum(t.numel for t in tensors)
    elems = search_chunk_size(tensors, 4, max_bytes=64 << 20, min_bytes=64 << 10)
    layout = build_layout(tensors, elems, 4)
    granule = IO_ALIGNMENT // 4
    # brute force: every 4 KiB multiple up to a block, no oversize chunk allowed
    brute = min(
        candidate.wasted_elems()
        for candidate in (
            build_layout(tensors, n * granule, 4) for n in range(16, total // layers // granule + 2)
        )
        if not any(c.oversize for c in candidate.chunks)
    )
    assert layout.wasted_elems() <= brute + total // 100  # within 1% of the model
    assert not any(c.oversize for c in layout.chunks)
    assert layout.num_chunks >= 16


def test_chunk_cap_rises_when_most_of_the_model_is_above_it():
    # Every matrix of these blocks is above the cap (a 70B GPT against 256 MiB):
    # searched under the plain cap, nearly everything is oversize.
    tensors = _gpt_blocks(16, 256)  # fp32: 0.25 MiB to 1 MiB matrices
    cap = 192 << 10
    total = sum(t.numel for t in tensors)
    raised = chunk_cap(tensors, 4, cap)
    assert raised > cap
    for limit, expect_oversize in ((cap, True), (raised, False)):
        elems = search_chunk_size(tensors, 4, max_bytes=limit, min_bytes=64 << 10)
        layout = build_layout(tensors, elems, 4)
        assert any(c.oversize for c in layout.chunks) == expect_oversize
    assert layout.wasted_elems() <= total // 50  # whole blocks' matrices pack tightly


def test_chunk_cap_stays_for_one_big_embedding():
    # One tensor above the cap (a large vocabulary) is fine as an oversize
    # chunk; raising the cap for it would only buy larger staging slots.
    tensors = [TensorInfo("embedding", (4096, 256), True), *_gpt_blocks(32, 128)]
    assert chunk_cap(tensors, 4, 1 << 20) == 1 << 20
