"""The chunk-optimizer interface: a second optimizer (SGD with momentum, one
state slot) plugs into the planner's sizing and the step's views."""

from __future__ import annotations

import pytest
import torch

from infinity.chunks.layout import TensorInfo, build_layout
from infinity.optim.cpu_adam import ADAM
from infinity.optim.sgd import SGD
from infinity.schedule.planner import Budgets, make_plan


@pytest.mark.parametrize("has_master", [False, True], ids=["fp32", "bf16"])
def test_the_planner_sizes_units_from_the_state_slots(has_master):
    elems, n = 4096, 5
    layout = build_layout([TensorInfo(f"w{i}", (elems,), True) for i in range(n)], elems, 2)
    plans = {
        opt.name: make_plan(
            layout,
            element_size=2,
            has_master=has_master,
            budgets=Budgets(1 << 24, 1 << 30, None),
            working_sets=[frozenset({i}) for i in range(n)],
            prefetch_depth=2,
            optimizer=opt,
        )
        for opt in (ADAM, SGD)
    }
    capacity = layout.chunks[0].capacity
    master = 1 if has_master else 0
    assert plans["sgd"].state_slots == ("momentum_buffer",)
    assert plans["adam"].state_slots == ("exp_avg", "exp_avg_sq")
    assert plans["sgd"].optim_bytes(0) == capacity * 4 * (1 + master)
    assert plans["adam"].optim_bytes(0) == capacity * 4 * (2 + master)
    # Homes hold parameters, gradients and units: only the unit size differs.
    saved = n * capacity * 4  # one fp32 part per chunk less than Adam
    assert plans["adam"].host_bytes - plans["sgd"].host_bytes == saved


@pytest.mark.parametrize("has_master", [False, True], ids=["fp32", "bf16"])
def test_unit_pieces_are_viewed_in_slot_order(has_master):
    # the step cuts a unit by its byte ranges and views the pieces (chunks/pieces.py)
    capacity = 8
    parts = 1 + has_master
    unit = torch.arange(parts * capacity, dtype=torch.float32)
    raw = unit.view(torch.uint8)
    ranges = SGD.tensor_ranges(capacity, has_master, 0, capacity)
    views = SGD.piece_views([raw[a : a + n] for a, n in ranges], has_master)
    assert list(views.state) == ["momentum_buffer"]
    buf = views.state["momentum_buffer"]
    assert buf.data_ptr() == unit.data_ptr() + (parts - 1) * capacity * 4  # a view, not a copy
    assert torch.equal(buf, torch.arange((parts - 1) * capacity, parts * capacity).float())
    assert (views.master is not None) == has_master
    if has_master:
        assert torch.equal(views.master, torch.arange(capacity).float())
