"""The CUDA backend's slots, copies and aliases, read back byte for byte.

Each check compares what landed with tensors the test made itself on the
host; the ordering checks race a long kernel on the compute stream against
the backend's copy stream, so a copy that did not wait for compute reads or
overwrites the wrong bytes.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_helpers import needs_cuda

pytestmark = needs_cuda


@pytest.fixture
def backend():
    from infinity.devices.choice import make_backend

    b = make_backend("cuda")
    yield b
    b.synchronize()
    b.close()


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_host_buffers_are_pinned_and_aligned(backend):
    host = backend.alloc_host(3 * 4096 + 5)
    assert host.is_pinned()
    assert host.data_ptr() % 4096 == 0
    dev = backend.alloc_device(1 << 20)
    assert dev.device.type == "cuda" and dev.numel() == 1 << 20


def test_round_trip_moves_exact_bytes_in_both_directions(backend):
    n = 3 << 20
    src = backend.alloc_host(n)
    src.copy_(_random_bytes(n, 0))
    dev = backend.alloc_device(n)
    backend.copy_async(dev, src).wait()
    back = backend.alloc_host(n)
    back.zero_()
    backend.copy_async(back, dev).wait()
    assert torch.equal(back, src)
    assert torch.equal(dev.cpu(), src)


def test_copies_of_many_sizes_touch_nothing_else(backend):
    slab = backend.alloc_device(1 << 16)
    slab.zero_()
    expected = torch.zeros(1 << 16, dtype=torch.uint8)
    offset, keep = 0, []
    for seed, n in enumerate([1, 7, 4096, 12345, 3, 40000]):
        src = backend.alloc_host(n)
        src.copy_(_random_bytes(n, seed))
        keep.append(src)
        backend.copy_async(slab[offset : offset + n], src)
        expected[offset : offset + n] = src
        offset += n + 5
    backend.synchronize()
    assert torch.equal(slab.cpu(), expected)


def _long_kernels(x: torch.Tensor, rounds: int = 40) -> None:
    for _ in range(rounds):
        x.mul_(1.0001).add_(1e-4)


def test_a_copy_out_waits_for_compute_issued_before_it(backend):
    # NOTE: the final value is written by the last of many kernels on the
    # compute stream; a copy that did not wait for them reads an earlier one.
    x = torch.zeros(1 << 24, device="cuda")
    _long_kernels(x)
    x.fill_(7.0)
    host = backend.alloc_host(x.numel() * 4).view(torch.float32)
    handle = backend.copy_async(host, x)
    handle.wait()
    assert handle.done()
    assert bool((host == 7.0).all())


def test_a_copy_into_a_slot_waits_for_compute_still_reading_it(backend):
    # The slot is read by queued kernels, then overwritten by a copy: the
    # kernels must see the old bytes (the engine reuses slots this way).
    slot = torch.full((1 << 22,), 2.0, device="cuda")
    acc = torch.zeros(1 << 22, device="cuda")
    for _ in range(30):
        acc.add_(slot)
    new = backend.alloc_host(slot.numel() * 4).view(torch.float32)
    new.fill_(100.0)
    backend.copy_async(slot, new).wait_for_compute()
    acc.add_(slot)  # ordered after the copy by wait_for_compute, not by the host
    torch.cuda.synchronize()
    assert bool((acc == 30 * 2.0 + 100.0).all())


def test_alias_shares_the_slot_but_owns_its_storage(backend):
    from torch.multiprocessing.reductions import StorageWeakRef

    slab = backend.alloc_device(1 << 20)
    slab.zero_()
    region = slab[4096 : 4096 + 8192]
    alias = backend.alias(region)
    assert alias.device == slab.device and alias.numel() == 8192
    assert alias.data_ptr() == region.data_ptr()
    # A storage of its own, starting at the region (the slab's starts 4 KiB before).
    assert alias.untyped_storage().data_ptr() == region.data_ptr()
    assert alias.untyped_storage().nbytes() == 8192
    alias.view(torch.float32).fill_(3.0)
    assert bool((slab[4096 : 4096 + 8192].view(torch.float32) == 3.0).all())
    assert int(slab[:4096].sum()) == 0 and int(slab[4096 + 8192 :].sum()) == 0
    ref = StorageWeakRef(alias.untyped_storage())
    view = alias.view(torch.float32)[10:20]
    del alias
    gc.collect()
    assert not ref.expired()  # a view keeps the alias's storage alive
    del view
    gc.collect()
    assert ref.expired()  # ... and nothing else does: the slot may be reused
