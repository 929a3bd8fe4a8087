"""The chunk manager on its own, built from a hand-made plan: placement and byte
accounting, host copies of NVMe-homed chunks, eviction order, and the gradient
path (device chunk -> home, accumulation, zeroed gaps), checked against tensors
computed here and bytes read back from the swap file."""

from __future__ import annotations

import pytest
import torch
from chunk_fakes import CHUNK_BYTES, CHUNK_ELEMS, small_plan

from infinity.chunks.manager import ChunkManager
from infinity.chunks.pieces import write_initial
from infinity.core.names import HOST, NVME, Kind
from infinity.core.plan import Plan
from infinity.devices.cpu import CpuBackend
from infinity.io import SwapFile, aligned_empty
from infinity.schedule.trace import BeladyPolicy, LRUPolicy

F32 = torch.float32


@pytest.fixture
def make(tmp_path):
    """``make(plan, policy=None)``: a manager on the CPU backend (and a swap file if
    the plan needs one); everything is closed after the test."""
    opened: list = []

    def build(plan: Plan, policy=None) -> tuple[ChunkManager, SwapFile | None]:
        backend = CpuBackend()
        swap = SwapFile(tmp_path, plan.nvme_bytes, name="direct") if plan.nvme_bytes else None
        opened.append((backend, swap))
        manager = ChunkManager(
            plan, F32, backend, swap, device_policy=policy or LRUPolicy(), host_policy=LRUPolicy
        )
        return manager, swap

    yield build
    for backend, swap in opened:
        backend.close()
        if swap is not None:
            swap.close()


def _values(i: int) -> torch.Tensor:
    return torch.arange(CHUNK_ELEMS, dtype=F32) * 0.5 - 100.0 * i


def _on_disk(swap: SwapFile, offset: int) -> torch.Tensor:
    buf = aligned_empty(CHUNK_BYTES, pinned=False)
    swap.read(buf, offset).wait()
    return buf.view(F32)


def test_placement_stays_in_budget_peaks_exactly_and_returns_every_slot(make):
    plan = small_plan([[CHUNK_ELEMS]] * 4, device_slots=2)
    manager, _ = make(plan)
    # Homes: per chunk a parameter and a gradient chunk (4 KiB each) and Adam's two fp32 moments.
    assert manager.host_account.used == 4 * (CHUNK_BYTES + CHUNK_BYTES + 2 * CHUNK_BYTES)
    for i in range(4):
        write_initial(manager, i, _values(i))
    for moment, i in enumerate([0, 1, 2, 3, 0, 2]):
        manager.moment = moment
        copy = manager.param_on_device(i)
        assert torch.equal(copy.typed(F32), _values(i))
        assert manager.device_account.used <= plan.budgets.device
    assert manager.device_account.peak == 2 * CHUNK_BYTES
    for key in manager.device.keys():
        manager.device.evict(key)
    manager.synchronize()
    assert manager.device_account.used == 0 and manager.device.keys() == []
    (pool,) = manager.device.pools.values()
    assert len([s for s in iter(pool.try_take, None)]) == 2  # both slots are free again


@pytest.mark.parametrize(
    ("policy", "victim"),
    [
        (LRUPolicy(), 1),  # chunk 0 was used again after chunk 1
        (BeladyPolicy({(Kind.PARAM, 0): [9], (Kind.PARAM, 1): [5]}, period=10), 0),  # 0: farthest
    ],
    ids=["lru", "belady"],
)
def test_a_full_device_tier_evicts_the_copy_the_policy_ranks_last(make, policy, victim):
    manager, _ = make(small_plan([[CHUNK_ELEMS]] * 3, device_slots=2), policy)
    for i in range(3):
        write_initial(manager, i, _values(i))
    for moment, i in enumerate([0, 1, 0, 2]):
        manager.moment = moment
        manager.param_on_device(i)
    kept = {0, 1} - {victim}
    assert set(manager.device.keys()) == {(Kind.PARAM, i) for i in (*kept, 2)}


def test_host_copies_of_an_nvme_home_write_only_when_modified(make):
    plan = small_plan([[CHUNK_ELEMS]], param_home=[NVME], grad_home=[None], staging={"param": 1})
    manager, swap = make(plan)
    key = (Kind.PARAM, 0)
    baseline = manager.host_account.used
    values = _values(3)

    region, copy = manager.open_host(key, load=False)
    assert manager.host_account.used == baseline + CHUNK_BYTES  # one staging slot taken
    region.view(F32).copy_(values)
    manager.close_host(copy, modified=True)
    assert manager.host_account.used == baseline  # and given back
    assert torch.equal(_on_disk(swap, 0), values)

    writes = manager.traffic.nvme_write_bytes
    region, copy = manager.open_host(key)
    assert torch.equal(region.view(F32), values)
    region.view(F32).zero_()  # changed, but closed as unmodified: nothing goes home
    manager.close_host(copy, modified=False)
    assert torch.equal(_on_disk(swap, 0), values)
    assert manager.traffic.nvme_write_bytes == writes

    region, copy = manager.open_host(key)
    manager.close_host(copy, modified=False, keep=True)
    reads = manager.traffic.nvme_read_bytes
    region, copy = manager.open_host(key)  # cached: no second read
    assert manager.traffic.nvme_read_bytes == reads
    assert torch.equal(region.view(F32), values)
    manager.close_host(copy, modified=False)
    assert manager.host_account.used == baseline


@pytest.mark.parametrize("home", [HOST, NVME])
def test_gradients_land_in_their_home_accumulate_and_unwritten_elements_are_zero(make, home):
    # One chunk of three tensors at elements [0, 300), [304, 504), [512, 612); the rest is gap.
    plan = small_plan(
        [[300, 200, 100]], grad_home=[home], device_slots=1, staging={"grad": 2, "optim": 1}
    )
    manager, swap = make(plan)
    slots = plan.layout.chunks[0].slots
    key = (Kind.GRAD, 0)
    if home == HOST:
        manager.homes.host(key).view(F32).fill_(7.0)  # stale bytes the flush must not keep

    def home_bytes() -> torch.Tensor:
        manager.synchronize()
        if home == HOST:
            return manager.homes.host(key).view(F32).clone()
        return _on_disk(swap, 0)  # the gradient chunk is the first NVMe home

    def micro_batch(grads: dict[int, torch.Tensor]) -> None:
        for t, g in grads.items():
            manager.grad_flow.write_grad(0, slots[t].offset, g)
        manager.grad_flow.flush_grad(0)

    g = torch.Generator().manual_seed(0)
    a, b, a2, c, b3 = (torch.randn(slots[t].numel, generator=g) for t in (0, 1, 0, 2, 1))
    expected = torch.zeros(CHUNK_ELEMS)
    micro_batch({0: a, 1: b})  # tensor 2 unused
    expected[0:300], expected[304:504] = a, b
    assert torch.equal(home_bytes(), expected)

    micro_batch({0: a2, 2: c})  # accumulation adds; tensor 1 unused this time
    expected[0:300] += a2
    expected[512:612] += c
    assert torch.equal(home_bytes(), expected)

    manager.grad_flow.invalidate_grads()  # zero_grad: the next flush overwrites
    micro_batch({1: b3})
    expected.zero_()
    expected[304:504] = b3
    assert torch.equal(home_bytes(), expected)
