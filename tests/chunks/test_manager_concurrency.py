"""Interleavings of the chunk manager's transfers, driven step by step: device copies
and swap-file transfers complete only when the test releases them (``chunk_fakes``),
so each race is forced in its worst order instead of hoped for with sleeps."""

from __future__ import annotations

import errno

import pytest
import torch
from chunk_fakes import CHUNK_BYTES, CHUNK_ELEMS, GatedSwap, HeldBackend, small_plan

from infinity.chunks.manager import ChunkManager
from infinity.chunks.pieces import write_initial
from infinity.core.names import NVME, Kind
from infinity.core.plan import Plan
from infinity.io import NVMeIOError, SwapFile
from infinity.schedule.trace import BeladyPolicy, LRUPolicy

F32 = torch.float32


def _manager(plan: Plan, backend: HeldBackend, swap=None, policy=None) -> ChunkManager:
    return ChunkManager(
        plan,
        F32,
        backend,
        swap,
        device_policy=policy or LRUPolicy(),
        host_policy=LRUPolicy,
    )


def _values(i: int) -> torch.Tensor:
    return torch.arange(CHUNK_ELEMS, dtype=F32) + 1000.0 * (i + 1)


def _param(i: int) -> tuple[Kind, int]:
    return (Kind.PARAM, i)


def test_prefetch_never_evicts_a_chunk_in_flight_and_a_consumer_waits_only_for_its_own():
    plan = small_plan([[CHUNK_ELEMS]] * 3)  # three host-homed chunks, two device slots
    backend = HeldBackend()
    # Chunk 2 is needed before 0 and 1: by the policy alone a prefetch of 2 may evict either.
    uses = {_param(0): [5], _param(1): [6], _param(2): [1]}
    manager = _manager(plan, backend, policy=BeladyPolicy(uses, period=10))
    for i in range(3):
        write_initial(manager, i, _values(i))
    assert manager.fetch_param(0, prefetch=True) is not None
    assert manager.fetch_param(1, prefetch=True) is not None
    assert len(backend.unfinished()) == 2

    # Both slots are still being filled: a prefetch gets "not now", and never blocks.
    assert manager.fetch_param(2, prefetch=True) is None
    assert backend.waited == [] and manager.device.keys() == [_param(0), _param(1)]

    # The consumer of chunk 1 waits for chunk 1's copy and for nothing else.
    on_device = manager.param_on_device(1)
    assert [c.dst.data_ptr() for c in backend.waited] == [on_device.tensor.data_ptr()]
    assert not backend.copies[0].done()
    assert torch.equal(on_device.typed(F32), _values(1))

    # Chunk 1 has landed, chunk 0 has not: the prefetch may take chunk 1's slot only.
    assert manager.fetch_param(2, prefetch=True) is not None
    assert _param(0) in manager.device and _param(1) not in manager.device
    assert not backend.copies[0].done() and backend.violations == []
    backend.release_all()
    for i in (0, 2):
        assert torch.equal(manager.param_on_device(i).typed(F32), _values(i))
    assert manager.device_account.peak == manager.device_account.used == 2 * CHUNK_BYTES


def test_a_blocking_fetch_with_every_slot_in_flight_waits_before_reusing_a_slot():
    plan = small_plan([[CHUNK_ELEMS]] * 3)
    backend = HeldBackend()
    manager = _manager(plan, backend)
    for i in range(3):
        write_initial(manager, i, _values(i))
    first = manager.fetch_param(0, prefetch=True)
    manager.fetch_param(1, prefetch=True)
    assert first is not None
    first_slot = first.tensor.data_ptr()

    on_device = manager.param_on_device(2)
    # The least recently used copy (chunk 0) was waited for, then its slot reused.
    assert backend.waited[0].dst.data_ptr() == first_slot == on_device.tensor.data_ptr()
    assert backend.violations == []
    assert _param(1) in manager.device and not backend.copies[1].done()
    assert torch.equal(on_device.typed(F32), _values(2))


@pytest.fixture
def gated(tmp_path):
    """A manager whose three parameter chunks live on NVMe behind a gate."""
    plan = small_plan(
        [[CHUNK_ELEMS]] * 3,
        param_home=[NVME] * 3,
        grad_home=[None] * 3,
        device_slots=1,
        staging={"param": 2},
    )
    swap = SwapFile(tmp_path, plan.nvme_bytes, name="gated")
    gate = GatedSwap(swap)
    yield _manager(plan, HeldBackend(), gate), gate
    swap.close()


def test_a_read_issued_while_its_write_is_in_flight_sees_the_new_bytes(gated):
    manager, gate = gated
    key = _param(0)
    old, new = _values(0), -_values(0)
    write_initial(manager, 0, old)  # waits for its write (the wait lets it through)
    assert torch.equal(gate.read_back(0, CHUNK_BYTES).view(F32), old)

    region, copy = manager.open_host(key)
    assert torch.equal(region.view(F32), old)
    region.view(F32).copy_(new)
    manager.close_host(copy, modified=True, keep=True)
    (write,) = gate.held("write")
    # The staging copy leaves while its write is in flight; the key is free at once.
    manager.staging[Kind.PARAM].evict(key)
    assert key not in manager.staging[Kind.PARAM]

    assert manager.prefetch_host(key)  # a read of the key, issued now
    for read in gate.held("read"):  # the worst order: reads land before the write
        read.release()
    write.release()
    region, copy = manager.open_host(key, writable=False)
    assert torch.equal(region.view(F32), new)
    assert torch.equal(gate.read_back(0, CHUNK_BYTES).view(F32), new)
    manager.close_host(copy, modified=False)


def test_a_failed_write_makes_every_later_check_and_read_raise(gated):
    manager, gate = gated
    key = _param(1)
    write_initial(manager, 1, _values(1))
    region, copy = manager.open_host(key)
    region.view(F32).neg_()
    manager.close_host(copy, modified=True, keep=True)
    (write,) = gate.held("write")
    write.release(fail_errno=errno.EIO)

    with pytest.raises(NVMeIOError) as first:
        manager.failures.check()
    assert first.value.errno == errno.EIO and "param chunk 1" in str(first.value)
    with pytest.raises(NVMeIOError, match="refuses to run"):
        manager.failures.check()
    # The home does not hold what was written: reading the chunk raises, never returns bytes.
    with pytest.raises(NVMeIOError):
        manager.open_host(key)
    assert manager.staging[Kind.PARAM].get(key) is not None  # kept: its bytes are not lost


def test_a_gradient_home_read_while_its_device_copy_is_in_flight_sees_the_gradients():
    plan = small_plan([[CHUNK_ELEMS]], device_slots=1)
    backend = HeldBackend()
    manager = _manager(plan, backend)
    grads = _values(0)
    manager.grad_flow.write_grad(0, 0, grads)
    manager.grad_flow.flush_grad(0)  # device -> host home, in flight
    assert len(backend.unfinished()) == 1
    region, _ = manager.open_host((Kind.GRAD, 0))
    assert torch.equal(region.view(F32), grads)


def test_a_staging_read_in_flight_is_never_evicted_and_a_reader_waits_only_for_its_own(gated):
    manager, gate = gated
    for i in range(3):
        write_initial(manager, i, _values(i))
    gate.waited.clear()
    assert manager.prefetch_host(_param(0)) and manager.prefetch_host(_param(1))
    first, second = gate.held("read")

    region, copy = manager.open_host(_param(1), writable=False)
    assert gate.waited == [second] and not first.done()
    assert torch.equal(region.view(F32), _values(1))
    manager.close_host(copy, modified=False, keep=True)

    # Both staging slots are taken, chunk 0's read is still in flight: the
    # prefetch of chunk 2 may take chunk 1's landed slot, never chunk 0's.
    assert manager.prefetch_host(_param(2))
    assert set(manager.staging[Kind.PARAM].keys()) == {_param(0), _param(2)}
    assert not first.done() and gate.waited == [second]
    for read in gate.held("read"):
        read.release()
    for i in (0, 2):
        assert manager.host.host_ready(_param(i))
        region, copy = manager.open_host(_param(i), writable=False)
        assert torch.equal(region.view(F32), _values(i))
        manager.close_host(copy, modified=False)


def test_nvme_gradient_reads_while_flushes_are_in_flight_see_the_newest_sum(tmp_path):
    plan = small_plan([[CHUNK_ELEMS]], grad_home=[NVME], device_slots=1, staging={"grad": 2})
    swap = SwapFile(tmp_path, plan.nvme_bytes, name="grads")
    gate, backend = GatedSwap(swap), HeldBackend()
    manager = _manager(plan, backend, gate)
    key = (Kind.GRAD, 0)  # the first NVMe home: offset 0
    first, second = _values(0), _values(1) * 0.25
    try:
        manager.grad_flow.write_grad(0, 0, first)
        manager.grad_flow.flush_grad(0)  # device -> staging, then staging -> NVMe
        assert len(backend.unfinished()) == 1 and gate.held() == []  # the write waits its turn
        region, copy = manager.open_host(key, writable=False)
        assert torch.equal(region.view(F32), first)
        manager.close_host(copy, modified=False, keep=True)
        manager.synchronize()
        assert torch.equal(gate.read_back(0, CHUNK_BYTES).view(F32), first)

        manager.grad_flow.write_grad(0, 0, second)
        manager.grad_flow.flush_grad(0)  # the next micro-batch adds, and the sum is written home
        (write,) = gate.held("write")
        region, copy = manager.open_host(key, writable=False)  # read while that write is held
        assert torch.equal(region.view(F32), first + second)
        manager.close_host(copy, modified=False, keep=True)
        assert torch.equal(gate.read_back(0, CHUNK_BYTES).view(F32), first)  # not yet home
        write.release()
        assert torch.equal(gate.read_back(0, CHUNK_BYTES).view(F32), first + second)
        assert backend.violations == []
    finally:
        swap.close()
