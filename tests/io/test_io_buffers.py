"""aligned_empty memory: exact size, aligned, and returned to the system when the tensor dies."""

from __future__ import annotations

import gc

import torch

from infinity.io import aligned_empty

PAGE = 4096


def _mapping_of(addr: int) -> tuple[int, int] | None:
    """(start, end) of the mapping in /proc/self/maps that starts exactly at ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start == addr:
                return start, end
    return None


def test_exact_size_mapping_is_freed_with_the_last_view():
    nbytes = 3 * 1024 * 1024 + 5 * PAGE  # not a power of two: pin_memory would round to 4 MiB
    t = aligned_empty(nbytes)
    addr = t.data_ptr()
    t.fill_(7)  # touch it, so it is real memory
    mapping = _mapping_of(addr)
    # NOTE: the kernel may merge adjacent anonymous mappings with equal
    # permissions, so the mapping can end later but never earlier than ours.
    assert mapping is not None and mapping[1] - mapping[0] >= nbytes
    view = t[PAGE:]
    del t
    gc.collect()
    assert int(view[0]) == 7  # the view alone keeps the memory
    del view
    gc.collect()
    after = _mapping_of(addr)
    assert after is None or after != mapping, "the mapping should be unmapped"


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
