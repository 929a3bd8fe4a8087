"""Round trips through the engine, checked through plain Python file I/O."""

from __future__ import annotations

import os
import random

import pytest
import torch
from io_helpers import file_bytes, random_tensor

from infinity.io import IOEngine, SwapFile, aligned_empty, wait_all

PAGE = 4096

# (block_size, queue_depth, threads): one piece at a time; odd block size over
# two workers; large blocks, deep queue.
CONFIGS = [(PAGE, 1, 1), (3 * PAGE, 3, 2), (1 << 20, 32, 1)]
# Odd multiples of 4 KiB: one page, a few pages, and sizes that are not a
# multiple of any block size above.
SIZES = [PAGE, 5 * PAGE, 77 * PAGE, 259 * PAGE + 0]
OFFSETS = [0, PAGE, 13 * PAGE]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"bs{c[0]}-qd{c[1]}-t{c[2]}")
def test_write_then_read_matches_python(make_engine, tmp_path, config):
    """Engine writes at odd sizes/offsets equal what Python reads; engine reads equal them too."""
    eng: IOEngine = make_engine(*config)
    with SwapFile(tmp_path, 4 << 20, eng) as sf:
        for i, (size, offset) in enumerate((s, o) for s in SIZES for o in OFFSETS):
            t, expected = random_tensor(size, seed=i)
            assert sf.write(t, offset).wait() == size
            assert file_bytes(sf.path, offset, size) == expected
            back = aligned_empty(size)
            back.zero_()
            assert sf.read(back, offset).wait() == size
            assert back.numpy().tobytes() == expected


def test_read_of_python_written_file(make_engine, tmp_path):
    """Data written with plain Python is read back exactly by the engine (other direction)."""
    eng = make_engine(block_size=8 * PAGE, queue_depth=4)
    path = tmp_path / "plain.bin"
    payload = os.urandom(123 * PAGE)
    path.write_bytes(payload)
    with open(path, "rb") as f:  # buffered fd: the engine must accept any regular file
        for offset, size in [(0, 123 * PAGE), (7 * PAGE, 9 * PAGE), (122 * PAGE, PAGE)]:
            t = aligned_empty(size)
            req = eng.read(t, f, offset)
            assert req.wait() == size
            assert t.numpy().tobytes() == payload[offset : offset + size]


def test_many_concurrent_requests(make_engine, tmp_path):
    """Dozens of in-flight writes and reads of different sizes land in the right places."""
    eng = make_engine(block_size=2 * PAGE, queue_depth=8, threads=2)
    rng = random.Random(7)
    with SwapFile(tmp_path, 8 << 20, eng) as sf:
        # Non-overlapping regions of random odd sizes.
        regions, cursor = [], 0
        while True:
            size = rng.choice([1, 3, 5, 17, 31]) * PAGE
            if cursor + size > sf.nbytes:
                break
            regions.append((cursor, size))
            cursor += size + rng.choice([0, PAGE, 3 * PAGE])
        assert len(regions) > 50
        tensors = [random_tensor(size, seed=100 + i) for i, (_, size) in enumerate(regions)]
        writes = [sf.write(t, off) for (off, _), (t, _) in zip(regions, tensors, strict=True)]
        assert wait_all(writes) == sum(size for _, size in regions)
        for (off, size), (_, expected) in zip(regions, tensors, strict=True):
            assert file_bytes(sf.path, off, size) == expected
        backs = [aligned_empty(size) for _, size in regions]
        reads = [sf.read(b, off) for (off, _), b in zip(regions, backs, strict=True)]
        wait_all(reads)
        for b, (_, expected) in zip(backs, tensors, strict=True):
            assert b.numpy().tobytes() == expected


def test_typed_tensors_and_raw_fd(make_engine, tmp_path):
    """Any dtype is moved as raw bytes; an int fd works as the target."""
    eng = make_engine()
    src = aligned_empty(16 * PAGE, torch.float32)
    src.copy_(torch.randn(src.numel()))
    path = tmp_path / "typed.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 16 * PAGE)
        eng.write(src, fd, 0).wait()
        dst = aligned_empty(16 * PAGE, torch.float32)
        eng.read(dst, fd, 0).wait()
    finally:
        os.close(fd)
    assert torch.equal(src, dst)
    assert path.read_bytes() == src.numpy().tobytes()


def test_progress_and_done(make_engine, tmp_path):
    """done() turns True and bytes_done reaches nbytes; a zero-byte request is done at once."""
    eng = make_engine()
    with SwapFile(tmp_path, 1 << 20, eng) as sf:
        t, _ = random_tensor(1 << 20, seed=3)
        req = sf.write(t, 0)
        assert req.nbytes == 1 << 20
        req.wait()
        assert req.done() and req.bytes_done == 1 << 20
        empty = sf.write(aligned_empty(0), 0)
        assert empty.wait() == 0 and empty.done()


def test_auto_backend_is_first_available(tmp_path):
    """backend='auto' resolves to the best working backend, and it moves data."""
    from infinity.io import available_backends

    working = available_backends()
    assert "threads" in working  # pread/pwrite work everywhere
    with IOEngine() as eng:
        assert eng.backend == working[0]
        with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
            t, expected = random_tensor(64 * PAGE, seed=11)
            sf.write(t, 0).wait()
            assert file_bytes(sf.path, 0, 64 * PAGE) == expected
