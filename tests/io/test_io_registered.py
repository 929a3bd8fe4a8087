"""Registered (io_uring fixed) buffers: same bytes on disk, no page pinning per transfer.

Every transfer is checked through plain Python file I/O, and the engine's
counter shows the fixed path was really taken.
"""

from __future__ import annotations

import pytest
from io_helpers import file_bytes, random_tensor

from infinity.io import IOEngine, SwapFile, aligned_empty, available_backends

PAGE = 4096
pytestmark = pytest.mark.skipif(
    "io_uring" not in available_backends(), reason="io_uring is not usable on this machine"
)


def _uring(block_size: int = 16 * PAGE, threads: int = 2) -> IOEngine:
    return IOEngine(
        {"backend": "io_uring", "block_size": block_size, "queue_depth": 8, "threads": threads}
    )


def test_transfers_inside_registered_buffers_land_exactly(tmp_path):
    eng = _uring()
    slabs = [aligned_empty(64 * PAGE), aligned_empty(96 * PAGE)]
    assert eng.register_buffers(slabs) is None
    with SwapFile(tmp_path, 1 << 20, eng) as sf:
        # views at offsets inside the second slab: a wrong buffer index or base
        # address would move other bytes than these
        for i, (start, pages, offset) in enumerate([(0, 96, 0), (7, 33, 5 * PAGE), (90, 6, 0)]):
            src, expected = random_tensor(pages * PAGE, seed=i)
            view = slabs[1][start * PAGE : (start + pages) * PAGE]
            view.copy_(src)
            assert sf.write(view, offset).wait() == pages * PAGE
            assert file_bytes(sf.path, offset, pages * PAGE) == expected
            back = slabs[0][: min(pages, 64) * PAGE]
            back.zero_()
            assert sf.read(back, offset).wait() == back.numel()
            assert back.numpy().tobytes() == expected[: back.numel()]
        assert eng.fixed_transfers > 0
        # a buffer outside every registered one still works (the plain path)
        before = eng.fixed_transfers
        other, expected = random_tensor(8 * PAGE, seed=9)
        assert sf.write(other, 0).wait() == 8 * PAGE
        assert file_bytes(sf.path, 0, 8 * PAGE) == expected
        assert eng.fixed_transfers == before
    eng.close()


def test_registration_is_refused_with_a_reason_and_io_still_works(tmp_path):
    eng = _uring(threads=1)
    slab = aligned_empty(16 * PAGE)
    assert eng.register_buffers([slab]) is None
    assert "already registered" in eng.register_buffers([slab])
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        eng.register_buffers([slab[::2]])
    eng.close()
    threads = IOEngine({"backend": "threads"})
    assert "threads backend" in threads.register_buffers([slab])
    with SwapFile(tmp_path, 1 << 20, threads) as sf:
        src, expected = random_tensor(16 * PAGE, seed=3)
        assert sf.write(src, 0).wait() == 16 * PAGE
        assert file_bytes(sf.path, 0, 16 * PAGE) == expected
    threads.close()
