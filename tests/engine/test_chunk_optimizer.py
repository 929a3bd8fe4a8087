"""The chunk-optimizer interface: a second optimizer (SGD with momentum, one
state slot) plugs into the planner's sizing, the step's views and a full
offloaded training run, compared against ``torch.optim.SGD``."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import batches, config, global_rel_error, param_bytes, tiny_gpt, train

import infinity
from infinity.chunks.layout import TensorInfo, build_layout
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.optim.chunk_optimizer import ADAM, ChunkOptimizer, StepViews
from infinity.optim.hyper import AdamHyperParams
from infinity.runtime import engine as engine_module
from infinity.schedule.planner import Budgets, make_plan

MOMENTUM = 0.9


class SGDMomentum(ChunkOptimizer[AdamHyperParams]):
    """SGD with momentum (torch's: ``buf = momentum * buf + g; p -= lr * buf``), in plain torch."""

    name = "sgd"
    state_slots = ("momentum_buffer",)

    def step(
        self, views: StepViews, hyper: AdamHyperParams, *, step: int, grad_scale: float
    ) -> None:
        buf = views.state["momentum_buffer"]
        buf.mul_(MOMENTUM).add_(views.grad.float() / grad_scale)
        views.master.sub_(hyper.lr * buf)
        if views.out16 is not None:
            views.out16.copy_(views.master)


SGD = SGDMomentum()


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
def test_unit_views_cut_the_unit_in_slot_order(has_master):
    capacity = 8
    parts = 1 + has_master
    unit = torch.arange(parts * capacity, dtype=torch.float32)
    views = SGD.unit_views(unit, capacity, has_master)
    assert list(views.state) == ["momentum_buffer"]
    buf = views.state["momentum_buffer"]
    assert buf.data_ptr() == unit.data_ptr() + (parts - 1) * capacity * 4  # a view, not a copy
    assert torch.equal(buf, torch.arange((parts - 1) * capacity, parts * capacity).float())
    assert (views.master is not None) == has_master
    if has_master:
        assert torch.equal(views.master, torch.arange(capacity).float())


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_an_offloaded_run_with_sgd_momentum_matches_torch_sgd(tmp_path, monkeypatch, placement):
    lr, steps = 0.05, 4
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=MOMENTUM, foreach=False)
    pbytes = param_bytes(model, 4)
    budgets = {}
    if placement == "nvme":
        budgets = {"host_memory": pbytes * 2, "nvme_path": str(tmp_path)}
    monkeypatch.setattr(engine_module, "ADAM", SGD)  # the engine's chunk optimizer
    model = infinity.offload(
        model, config(device_memory=pbytes * 6 // 10, chunk_size="24KiB", **budgets)
    )
    engine = engine_of(model)
    assert engine.chunk_optimizer is SGD and engine.plan.state_slots == ("momentum_buffer",)
    if placement == "nvme":
        assert "nvme" in {str(t) for t in engine.plan.optim_home}
    # CPUAdam supplies the learning rate; the engine's chunk optimizer runs the update.
    opt = CPUAdam(model.parameters(), lr=lr, weight_decay=0.0)
    data = batches(steps)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert global_rel_error(model, ref) < 1e-5
    # The optimizer state dict carries the slot by its name, as torch's SGD does.
    state = opt.state_dict()["state"]
    ref_state = ref_opt.state_dict()["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        assert set(state[key]) == {"step", "momentum_buffer"}
        torch.testing.assert_close(
            state[key]["momentum_buffer"], value["momentum_buffer"], rtol=1e-4, atol=1e-6
        )
    engine.close()
