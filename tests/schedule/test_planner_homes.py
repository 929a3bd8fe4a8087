"""Host room and the optimizer: homes before staging depth, per-tensor states in the budget.

Where states live on NVMe, a host home saves two or three transfers of its
bytes per step, a parameter staging slot beyond the pipelines' minimum only
lets a read start earlier: the planner gives room to homes first. An optimizer with
less state per parameter than Adam (Lion, SGD) frees room that must become
homes. And the host budget holds the optimizer's per-tensor states too
(Adafactor's row and column factors), which live beside the homes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import param_bytes, tiny_gpt

from infinity.bench.train_cases import host_budget_for
from infinity.config import Config
from infinity.core.names import HOST, NVME
from infinity.core.plan import Plan
from infinity.models.gpt import GPT, GPTConfig
from infinity.optim.adafactor import ADAFACTOR
from infinity.optim.cpu_adam import ADAM
from infinity.optim.lion import LION
from infinity.optim.sgd import SGD
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import MIN_PARAM_STAGING, PlanError
from infinity.schedule.units import units_for

CPU = torch.device("cpu")
# `infinity bench train`'s model (GPT 25.5M, fp32) and budgets.
BENCH = GPTConfig(vocab_size=256, seq_len=256, layers=8, hidden=512, heads=8)
OPTIMIZERS = {"adam": ADAM, "lion": LION, "sgd": SGD, "adafactor": ADAFACTOR}


def _nvme_bytes(plan: Plan) -> int:
    return plan.traffic["nvme_read_bytes"] + plan.traffic["nvme_write_bytes"]


def _plans(registry: ParamRegistry, config: Config) -> dict[str, Plan]:
    """Each optimizer's plan with the budgets Adam's resolved (as a re-home plans)."""
    adam = plan_for(registry, config, CPU)
    return {
        name: plan_for(registry, config, CPU, opt, budgets=adam.budgets)
        for name, opt in OPTIMIZERS.items()
    }


@pytest.fixture(scope="module")
def bench_plans(tmp_path_factory) -> dict[str, dict[str, Plan]]:
    """The plans of `infinity bench train`'s NVMe cases, per case and optimizer."""
    with torch.device("meta"):
        registry = ParamRegistry.from_model(GPT(BENCH))
    base = Config(
        device="cpu",
        dtype="fp32",
        device_memory=BENCH.num_params * 4 // 2,
        nvme_path=str(tmp_path_factory.mktemp("nvme")),
        nvme_memory="64GiB",
    )
    # The same budgets as infinity/bench/train_cases.py's run_all.
    optim_only = host_budget_for(
        BENCH, base, lambda p: NVME not in p.param_home and NVME not in p.grad_home
    )
    small = max(host_budget_for(BENCH, base, lambda p: True), BENCH.num_params * 16 * 15 // 100)
    cases = {
        "c0": base.replace(host_memory=optim_only),
        "d": base.replace(host_memory=small, overlap_optimizer=True),
        "d0": base.replace(host_memory=small),
    }
    return {case: _plans(registry, config) for case, config in cases.items()}


def test_lion_plans_fewer_nvme_bytes_where_adams_states_spill(bench_plans):
    """Lion's planned NVMe bytes per step against AdamW's on the bench's NVMe cases.

    c0 (only optimizer units on NVMe) meets issue 29's 0.55x. At d and d0's host
    budget (15% of Adam's states, 61 MB: 46 MB of it staging at the pipelines'
    depth) nearly every parameter and gradient crosses the disk for both
    optimizers (~250 MB of a step that Lion's smaller units do not touch), so
    0.55x is out of reach there; the bounds are what giving the freed room to
    homes reaches (0.65x and 0.75x), where six staging slots instead of two more
    homes gave 0.69x and 0.78x.
    """
    bounds = {"c0": 0.55, "d": 0.66, "d0": 0.76}
    for case, plans in bench_plans.items():
        adam = _nvme_bytes(plans["adam"])
        for name in ("lion", "sgd"):
            assert _nvme_bytes(plans[name]) <= bounds[case] * adam, (case, name)
    # Adafactor (fp32: no unit at all) at d, the overlapped case, meets its 0.3x.
    assert _nvme_bytes(bench_plans["d"]["adafactor"]) <= 0.3 * _nvme_bytes(bench_plans["d"]["adam"])


def test_the_room_lion_frees_becomes_homes_not_staging_depth(bench_plans):
    for case in ("d", "d0"):
        adam, lion = bench_plans[case]["adam"], bench_plans[case]["lion"]
        assert max(lion.host_staging["param"].values()) <= MIN_PARAM_STAGING
        homes = [sum(h == HOST for h in plan.param_home) for plan in (adam, lion)]
        assert homes[1] >= homes[0] + 2, (case, homes)


def _extra_param_slots(plan: Plan) -> int:
    """Bytes of parameter staging slots beyond the pipelines' minimum."""
    pool = plan.host_staging.get("param", {})
    return sum(size * max(0, count - MIN_PARAM_STAGING) for size, count in pool.items())


def _nvme_homes(plan: Plan) -> list[int]:
    """Bytes of each home the plan keeps on NVMe."""
    n = plan.layout.num_chunks
    homes = [plan.param_bytes(i) for i in range(n) if plan.param_home[i] == NVME]
    homes += [plan.param_bytes(i) for i in range(n) if plan.grad_home[i] == NVME]
    homes += [plan.optim_bytes(i) for i in range(n) if plan.optim_home[i] == NVME]
    return homes


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_staging_depth_never_holds_room_a_home_would_take(name, overlap, tmp_path):
    """Over a sweep of host budgets: parameter staging deeper than the pipelines'
    minimum only where the room of the extra slots (and what is left over) holds no
    NVMe home."""
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    pbytes = param_bytes(model, 4)
    spilled = 0
    for percent in range(40, 400, 8):
        config = _tiny_config(
            tmp_path, "fp32", pbytes * 6 // 10, pbytes * percent // 100, overlap_optimizer=overlap
        )
        try:
            budgets = plan_for(registry, config, CPU).budgets
            plan = plan_for(registry, config, CPU, OPTIMIZERS[name], budgets=budgets)
        except PlanError:
            continue
        spilled += NVME in plan.param_home
        room = _extra_param_slots(plan) + plan.budgets.host - plan.host_bytes
        if _extra_param_slots(plan):
            assert all(home > room for home in _nvme_homes(plan)), (percent, plan.host_staging)
    assert spilled >= 5  # the sweep reaches budgets where parameters stage from NVMe


def _tiny_config(tmp_path, dtype: str, device_memory: int, host_memory: int, **kw) -> Config:
    """A CPU config for the tiny GPT: 24 KiB chunks, the rest of the states on NVMe."""
    return Config(
        device="cpu",
        dtype=dtype,
        device_memory=device_memory,
        chunk_size="24KiB",
        host_memory=host_memory,
        nvme_path=str(tmp_path),
        nvme_memory="1GiB",
        **kw,
    )


def _factor_bytes(model: torch.nn.Module) -> int:
    """Bytes of torch.optim.Adafactor's state for ``model`` after one step (its factors)."""
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adafactor(params, foreach=False)
    opt.step()
    return sum(
        value.nbytes
        for state in opt.state.values()
        for key, value in state.items()
        if key != "step"
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adafactors_factors_are_inside_the_host_budget(dtype, tmp_path):
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    factors = _factor_bytes(model)
    pbytes = param_bytes(model, 4)
    planned = 0
    for percent in range(40, 300, 3):
        config = _tiny_config(tmp_path, dtype, pbytes * 6 // 10, pbytes * percent // 100)
        try:
            plan = plan_for(registry, config, CPU, ADAFACTOR)
        except PlanError:
            continue
        planned += 1
        assert plan.tensor_state_bytes == factors
        held = plan.home_bytes(HOST) + plan.staging_bytes + factors
        assert plan.host_bytes == held <= plan.budgets.host, percent
    assert planned > 50
    # The other optimizers keep nothing per tensor.
    for opt in (ADAM, LION, SGD):
        assert plan_for(registry, config, CPU, opt).tensor_state_bytes == 0


def test_a_host_budget_below_the_factors_names_them(tmp_path):
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    config = _tiny_config(tmp_path, "fp32", param_bytes(model, 4), _factor_bytes(model) - 1)
    with pytest.raises(PlanError, match="per-tensor states"):
        plan_for(registry, config, CPU, ADAFACTOR)


def test_units_recut_inside_homes_too_small_for_the_factors_is_an_error(tmp_path):
    """Homes kept for another optimizer (``units_for``): the per-tensor states must
    fit beside them too, or the optimizer's constructor says so."""
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    config = _tiny_config(tmp_path, "bf16", param_bytes(model, 4), param_bytes(model, 4) * 3)
    plan = plan_for(registry, config, CPU, ADAFACTOR)
    assert units_for(plan, ADAFACTOR, consume_grads=False).host_bytes == plan.host_bytes
    tight = dataclasses.replace(
        plan, budgets=dataclasses.replace(plan.budgets, host=plan.host_bytes - 1)
    )
    with pytest.raises(PlanError, match="host_memory=.* per-tensor states .* do not fit"):
        units_for(tight, ADAFACTOR, consume_grads=False)
