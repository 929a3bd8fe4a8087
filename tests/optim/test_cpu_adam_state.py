"""CPUAdam checkpoints move to and from torch.optim.AdamW/Adam; LR schedulers drive it."""

from __future__ import annotations

import copy

import pytest
import torch
from adam_reference import assert_rel_close

from infinity.optim import CPUAdam


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, sched=None) -> None:
    # NOTE: fixed pseudo-gradients rather than backward(): with real gradients
    # the ulp-level differences between two correct optimizers feed back into
    # the next gradients and grow; here only the optimizers are compared.
    for step in steps:
        opt.zero_grad()
        for i, p in enumerate(model.parameters()):
            gen = torch.Generator().manual_seed(1000 * step + i)
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1)
        opt.step()
        if sched is not None:
            sched.step()


def _assert_models_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert_rel_close(pa.detach(), pb.detach())


def _groups(model: torch.nn.Module) -> list[dict]:
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), "weight_decay": 0.1},
        {"params": list(second.parameters()), "lr": 3e-3},
    ]


@pytest.mark.parametrize(
    ("adamw", "torch_cls"),
    [(True, torch.optim.AdamW), (False, torch.optim.Adam)],
    ids=["adamw", "adam"],
)
def test_checkpoint_from_cpu_adam_continues_in_torch(adamw: bool, torch_cls: type) -> None:
    reference = _model()
    ref_opt = torch_cls(_groups(reference), lr=1e-2, foreach=False)  # both at torch's defaults
    _train(reference, ref_opt, range(10))

    model = _model()
    opt = CPUAdam(_groups(model), lr=1e-2, adamw=adamw)
    _train(model, opt, range(5))
    sd = copy.deepcopy(opt.state_dict())
    # the per-parameter state is exactly torch's
    for state in sd["state"].values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    resumed = torch_cls(_groups(model), lr=1e-2, foreach=False)
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["decoupled_weight_decay"] is adamw
    assert resumed.param_groups[0]["weight_decay"] == 0.1
    _train(model, resumed, range(5, 10))
    _assert_models_close(model, reference)


@pytest.mark.parametrize(
    ("adamw", "torch_cls"),
    [(True, torch.optim.AdamW), (False, torch.optim.Adam)],
    ids=["adamw", "adam"],
)
def test_checkpoint_from_torch_continues_in_cpu_adam(adamw: bool, torch_cls: type) -> None:
    reference = _model()
    ref_opt = torch_cls(_groups(reference), lr=1e-2, weight_decay=0.0, foreach=False)
    _train(reference, ref_opt, range(10))

    model = _model()
    opt = torch_cls(_groups(model), lr=1e-2, weight_decay=0.0, foreach=False)
    _train(model, opt, range(5))
    # NOTE: a CPUAdam built with the *other* mode: the checkpoint's
    # decoupled_weight_decay decides, as it does between torch's Adam and AdamW.
    resumed = CPUAdam(_groups(model), lr=1e-2, adamw=not adamw)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(g["adamw"] is adamw for g in resumed.param_groups)
    _train(model, resumed, range(5, 10))
    _assert_models_close(model, reference)
    # and back again: the round trip keeps every key torch needs
    again = torch_cls(_groups(model), lr=1e-2, foreach=False)
    again.load_state_dict(resumed.state_dict())
    assert again.state_dict()["param_groups"][0]["decoupled_weight_decay"] is adamw


def test_own_checkpoint_round_trip() -> None:
    model = _model()
    opt = CPUAdam(_groups(model), lr=1e-2)
    _train(model, opt, range(3))
    twin = copy.deepcopy(model)
    twin_opt = CPUAdam(_groups(twin), lr=5.0, adamw=False)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert twin_opt.param_groups[0]["lr"] == 1e-2 and twin_opt.param_groups[0]["adamw"] is True
    _train(model, opt, range(3, 6))
    _train(twin, twin_opt, range(3, 6))
    for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_lr_scheduler_drives_cpu_adam_like_torch() -> None:
    reference = _model()
    ref_opt = torch.optim.AdamW(_groups(reference), lr=1e-2, foreach=False)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[2e-2, 5e-3], total_steps=20)
    _train(reference, ref_opt, range(20), ref_sched)

    model = _model()
    opt = CPUAdam(_groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=20)
    lrs = []
    for step in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        _train(model, opt, range(step, step + 1), sched)
    assert len(set(lrs)) > 10  # the schedule really changed the LR
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    _assert_models_close(model, reference)
