"""The planner: placement order, budgets respected, errors before allocation."""

from __future__ import annotations

import pytest

from infinity.chunks.layout import TensorInfo, build_layout
from infinity.schedule.planner import HOST, NVME, Budgets, PlanError, make_plan

E = 2  # bf16


def _layout(n_chunks=8, elems=8192, frozen=0):
    tensors = [TensorInfo(f"w{i}", (elems,), i >= frozen) for i in range(n_chunks)]
    return build_layout(tensors, elems, E)


def _plan(layout, device, host, nvme, has_master=True):
    sets = [frozenset({i}) for i in range(layout.num_chunks)]
    return make_plan(
        layout,
        element_size=E,
        has_master=has_master,
        budgets=Budgets(device, host, nvme),
        working_sets=sets,
        prefetch_depth=2,
    )


def test_everything_on_host_when_it_fits():
    layout = _layout()
    plan = _plan(layout, device=1 << 20, host=1 << 30, nvme=None)
    assert set(plan.param_home) == {HOST} and set(plan.optim_home) == {HOST}
    assert plan.host_bytes <= 1 << 30 and plan.device_bytes <= 1 << 20


def test_optimizer_state_spills_first_then_grads_then_params():
    layout = _layout()
    chunk = layout.chunk_bytes
    full = _plan(layout, device=1 << 20, host=1 << 30, nvme=1 << 30).host_bytes
    # room for everything but a few optimizer units
    plan = _plan(layout, device=1 << 20, host=full - 3 * chunk * 6, nvme=1 << 30)
    assert NVME in plan.optim_home
    assert set(plan.grad_home) == {HOST} and set(plan.param_home) == {HOST}
    tight = _plan(layout, device=1 << 20, host=full // 2, nvme=1 << 30)
    assert set(tight.optim_home) == {NVME}
    assert NVME in tight.grad_home or NVME in tight.param_home
    for plan_ in (plan, tight):
        assert plan_.host_bytes <= plan_.budgets.host
        assert plan_.device_bytes <= plan_.budgets.device
        assert plan_.nvme_bytes <= plan_.budgets.nvme


def test_frozen_chunks_have_no_grad_or_optimizer_state():
    plan = _plan(_layout(frozen=3), device=1 << 20, host=1 << 30, nvme=None)
    assert plan.grad_home[:3] == (None, None, None)
    assert plan.optim_home[:3] == (None, None, None)


def test_errors_name_the_bytes_needed():
    layout = _layout()
    with pytest.raises(PlanError, match="device_memory=.*at least"):
        _plan(layout, device=1000, host=1 << 30, nvme=None)
    with pytest.raises(PlanError, match="set nvme_path"):
        _plan(layout, device=1 << 20, host=1 << 16, nvme=None)
    with pytest.raises(PlanError, match="staging buffers alone need"):
        _plan(layout, device=1 << 20, host=1 << 12, nvme=1 << 30)
    full = _plan(layout, device=1 << 20, host=1 << 30, nvme=None).host_bytes
    with pytest.raises(PlanError, match="nvme_memory"):
        _plan(layout, device=1 << 20, host=full // 2, nvme=1 << 12)


def test_device_slots_cover_the_largest_working_set():
    layout = _layout()
    sets = [frozenset({0, 1, 2})]
    plan = make_plan(
        layout,
        element_size=E,
        has_master=True,
        budgets=Budgets(4 * layout.chunk_bytes, 1 << 30, None),
        working_sets=sets,
        prefetch_depth=0,
    )
    assert sum(plan.device_slots.values()) == 4  # three parameter chunks + one gradient
    with pytest.raises(PlanError):
        make_plan(
            layout,
            element_size=E,
            has_master=True,
            budgets=Budgets(3 * layout.chunk_bytes, 1 << 30, None),
            working_sets=sets,
            prefetch_depth=0,
        )


def test_spare_device_room_buys_slots_for_oversize_chunks_too():
    # Every other tensor is larger than a chunk (oversize; two sizes of them):
    # a large device budget must cache them as well, not only normal chunks.
    sizes = [8192 if i % 2 else 20_000 + 4096 * (i % 4) for i in range(24)]
    layout = build_layout([TensorInfo(f"w{i}", (n,), True) for i, n in enumerate(sizes)], 8192, E)
    assert any(c.oversize for c in layout.chunks)
    chunk_bytes = [c.capacity * E for c in layout.chunks]
    copies = 2 * sum(chunk_bytes)  # a parameter and a gradient copy of every chunk
    budget = copies // 2
    plan = _plan(layout, device=budget, host=1 << 30, nvme=None)
    assert plan.device_bytes <= budget
    assert plan.device_bytes >= budget - max(chunk_bytes)  # the room is spent
    # slots an oversize chunk fits get the oversize chunks' share of the budget
    oversize = [c.capacity * E for c in layout.chunks if c.oversize]
    share = budget * 2 * sum(oversize) // copies
    usable = sum(slot * count for slot, count in plan.device_slots.items() if slot >= min(oversize))
    assert usable >= share - max(chunk_bytes), (usable, share, plan.device_slots)
    # more room than copies: one slot per copy, none idle
    roomy = _plan(layout, device=4 * copies, host=1 << 30, nvme=None)
    assert roomy.device_bytes == copies


def test_overlapped_gradients_spill_before_optimizer_units():
    """Overlapped, a gradient chunk on NVMe is used from staging and never written:
    spilling it first keeps optimizer units (a read and a write each per step) home."""
    layout = _layout()
    full = _plan(layout, device=1 << 20, host=1 << 30, nvme=1 << 30).host_bytes
    sets = [frozenset({i}) for i in range(layout.num_chunks)]
    plans = [
        make_plan(
            layout,
            element_size=E,
            has_master=True,
            budgets=Budgets(1 << 20, full - 40 * 1024, 1 << 30),  # 2.5 gradient chunks short
            working_sets=sets,
            prefetch_depth=2,
            consume_grads=overlap,
        )
        for overlap in (False, True)
    ]
    default, overlapped = plans
    assert NVME in overlapped.grad_home and NVME not in overlapped.optim_home
    assert NVME in default.optim_home
    disk = [p.traffic["nvme_read_bytes"] + p.traffic["nvme_write_bytes"] for p in plans]
    assert disk[1] < disk[0]
