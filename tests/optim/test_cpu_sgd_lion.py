"""CPUSGD and CPULion on plain CPU tensors, against ``torch.optim.SGD`` and Lion in torch ops.

CPUSGD runs the fused SGD kernel, torch's single-tensor SGD operation for
operation (tests/optim/test_sgd_kernel.py), so its parameters and momentum
buffers equal ``torch.optim.SGD(foreach=False)``'s bit for bit, and
state dicts move between the two both ways. CPULion runs the fused kernel:
close to the reference written in torch ops (``lion_reference.ReferenceLion``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from lion_reference import ReferenceLion

from infinity.optim import CPUSGD, CPULion

STEPS = 5


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of several shapes, one of them a transposed (non-contiguous) view."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33,), (8, 17), (4, 3, 5)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(6, 9, generator=gen).t()))
    return params


def _grads(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _train(opt: torch.optim.Optimizer, params, steps=range(STEPS)) -> None:
    for step in steps:
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g if step != 2 or p.dim() != 2 else None  # some skip a step, as torch
        opt.step()


SGD_CASES = {
    "plain": {},
    "momentum-decay": {"momentum": 0.9, "weight_decay": 0.01},
    "nesterov": {"momentum": 0.8, "nesterov": True, "weight_decay": 0.1},
    "dampening-maximize": {"momentum": 0.5, "dampening": 0.3, "maximize": True},
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_cpu_sgd_is_torch_sgd_bit_for_bit(case) -> None:
    kwargs = {"lr": 0.05, **SGD_CASES[case]}
    ours, theirs = _params(), _params()
    _train(CPUSGD(ours, **kwargs), ours)
    _train(torch.optim.SGD(theirs, foreach=False, **kwargs), theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_sgd_state_dicts_move_between_cpu_sgd_and_torch_both_ways() -> None:
    kwargs = {"lr": 0.05, "momentum": 0.9, "nesterov": True}
    whole = _params()
    _train(CPUSGD(whole, **kwargs), whole)
    # infinity -> torch: two steps here, the rest in torch.optim.SGD.
    ours = _params()
    first = CPUSGD(ours, **kwargs)
    _train(first, ours, range(2))
    theirs = torch.optim.SGD(ours, foreach=False, **kwargs)
    theirs.load_state_dict(first.state_dict())
    _train(theirs, ours, range(2, STEPS))
    # torch -> infinity: torch keeps no step count (its momentum buffer is the state).
    back = _params()
    torch_first = torch.optim.SGD(back, foreach=False, **kwargs)
    _train(torch_first, back, range(2))
    second = CPUSGD(back, **kwargs)
    second.load_state_dict(torch_first.state_dict())
    _train(second, back, range(2, STEPS))
    for a, b, c in zip(whole, ours, back, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_cpu_sgd_checks_its_hyper_parameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="Invalid lr"):
        CPUSGD(p, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid momentum"):
        CPUSGD(p, momentum=-0.5)
    with pytest.raises(ValueError, match=r"nesterov=True needs momentum > 0 and dampening == 0"):
        CPUSGD(p, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="CPUSGD does not implement fused=True"):
        CPUSGD(p, fused=True)
    with pytest.raises(TypeError, match="CPUSGD keeps fp32 master parameters"):
        CPUSGD([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_cpu_lion_follows_the_reference(decay) -> None:
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": decay}
    ours, theirs = _params(), _params()
    opt = CPULion(ours, **kwargs)
    ref = ReferenceLion(theirs, **kwargs)
    _train(opt, ours)
    _train(ref, theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert opt.state[p]["step"].item() == (STEPS - 1 if p.dim() == 2 else STEPS)


def test_cpu_lion_resumes_from_its_state_dict() -> None:
    whole = _params()
    _train(CPULion(whole, lr=1e-2), whole)
    resumed = _params()
    first = CPULion(resumed, lr=1e-2)
    _train(first, resumed, range(3))
    state = copy.deepcopy(first.state_dict())
    second = CPULion(resumed, lr=1e-2)
    second.load_state_dict(state)
    _train(second, resumed, range(3, STEPS))
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)


def test_cpu_lion_defaults_and_checks() -> None:
    opt = CPULion([torch.nn.Parameter(torch.zeros(3))])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)
    with pytest.raises(ValueError, match=r"Invalid betas\[1\]"):
        CPULion([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="is on 'meta'"):
        CPULion([torch.nn.Parameter(torch.zeros(3, device="meta"))])
