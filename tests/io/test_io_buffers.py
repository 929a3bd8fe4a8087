"""aligned_empty memory: exact size, aligned, and returned to the system when the tensor dies."""

from __future__ import annotations

import gc

import torch

from infinity.io import aligned_empty, buffers

PAGE = 4096


def _mapped(addr: int, nbytes: int) -> bool:
    """True if ``[addr, addr + nbytes)`` lies inside one mapping of /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr and addr + nbytes <= end:
                return True
    return False


def test_exact_size_memory_is_freed_with_the_last_view(monkeypatch):
    freed: list[int] = []
    gc.collect()  # NOTE: earlier tests' dropped engines must not be counted below
    # Record when the owner of the memory dies, and its size (CUDA is not in
    # play here, so skipping the real __del__'s cudaHostUnregister is harmless).
    monkeypatch.setattr(buffers._HostRegion, "__del__", lambda self: freed.append(len(self)))
    nbytes = 3 * 1024 * 1024 + 5 * PAGE  # not a power of two: pin_memory would round to 4 MiB
    t = aligned_empty(nbytes)
    addr = t.data_ptr()
    t.fill_(7)
    assert _mapped(addr, nbytes)
    view = t[PAGE:]
    del t
    gc.collect()
    assert freed == []  # the view alone keeps the memory
    assert int(view[0]) == 7
    del view
    gc.collect()
    assert freed == [nbytes]  # exactly the rounded-up size (already a multiple of 4 KiB)
    odd = aligned_empty(PAGE + 8)
    del odd
    gc.collect()
    assert freed == [nbytes, 2 * PAGE]


def test_many_allocations_do_not_leak():
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    for _ in range(50):
        t = aligned_empty(8 << 20)
        t.fill_(1)
        del t
    gc.collect()
    grown = proc.memory_info().rss - before
    assert grown < 64 << 20, f"RSS grew by {grown} bytes over 50 x 8 MiB allocations"


def test_sizes_round_to_pages_not_powers_of_two():
    t = aligned_empty(PAGE + 4, torch.int32)
    assert t.numel() == (PAGE + 4) // 4
    assert t.untyped_storage().nbytes() == PAGE + 4


def _huge_advised(addr: int, nbytes: int) -> bool:
    """True if the mapping holding ``addr`` has ``hg`` (MADV_HUGEPAGE) in /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr and addr + nbytes <= end
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_buffers_start_on_a_huge_page_and_ask_for_huge_pages(monkeypatch):
    # See NOTE [huge I/O buffers]: from MIN_HUGE_BYTES up, the buffer starts
    # on a 2 MiB boundary and its mapping is advised MADV_HUGEPAGE; smaller
    # ones stay exact-size small-page mappings.
    nbytes = buffers.MIN_HUGE_BYTES + 5 * PAGE  # not a whole number of huge pages
    t = aligned_empty(nbytes)
    assert t.data_ptr() % buffers.HUGE_PAGE == 0
    assert t.numel() == nbytes and t.untyped_storage().nbytes() == nbytes
    t.fill_(3)
    assert int(t[-1]) == 3 and _mapped(t.data_ptr(), nbytes)
    assert _huge_advised(t.data_ptr(), nbytes)
    small = aligned_empty(buffers.MIN_HUGE_BYTES - PAGE)
    assert small.data_ptr() % PAGE == 0
    assert not _huge_advised(small.data_ptr(), small.numel())


def test_large_buffers_round_trip_through_the_engine(tmp_path):
    from infinity.config import AioConfig
    from infinity.io import IOEngine, SwapFile

    nbytes = buffers.MIN_HUGE_BYTES + 3 * PAGE
    src = aligned_empty(nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dst = aligned_empty(nbytes)
    with IOEngine(AioConfig(block_size="4MiB")) as engine, SwapFile(tmp_path, nbytes, engine) as sf:
        assert engine.register_buffers([src, dst]) in (
            None,
            f"the {engine.backend} backend has no registered buffers",
        )
        sf.write(src, 0).wait()
        sf.read(dst, 0).wait()
    assert torch.equal(src, dst)
