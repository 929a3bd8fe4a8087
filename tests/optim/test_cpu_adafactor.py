"""CPUAdafactor on plain CPU tensors against ``torch.optim.Adafactor`` in the same test.

CPUAdafactor runs torch's single-tensor Adafactor operations in its order, so
parameters and states (``row_var`` and ``col_var`` for matrices and higher,
``variance`` for vectors) equal ``torch.optim.Adafactor(foreach=False)``'s bit
for bit, and state dicts move between the two both ways.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from infinity.optim import CPUAdafactor

STEPS = 5


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of several ranks, one of them a transposed (non-contiguous) view."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33,), (8, 17), (4, 3, 5), ()]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(6, 9, generator=gen).t()))
    return params


def _train(opt: torch.optim.Optimizer, params, steps=range(STEPS)) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            p.grad = g if step != 2 or p.dim() != 2 else None  # some skip a step, as torch
        opt.step()


CASES = {
    "defaults": {},
    "decay-lr": {"lr": 0.05, "weight_decay": 0.1},
    "eps-d-maximize": {"eps": (1e-20, 1e-2), "d": 1.5, "maximize": True, "beta2_decay": -0.5},
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_adafactor_is_torch_adafactor_bit_for_bit(case) -> None:
    ours, theirs = _params(), _params()
    opt = CPUAdafactor(ours, **CASES[case])
    ref = torch.optim.Adafactor(theirs, foreach=False, **CASES[case])
    _train(opt, ours)
    _train(ref, theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert set(opt.state[p]) == set(ref.state[q])
        for key, value in ref.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


def test_adafactor_state_dicts_move_between_cpu_adafactor_and_torch_both_ways() -> None:
    whole = _params()
    _train(CPUAdafactor(whole, weight_decay=0.01), whole)
    # infinity -> torch
    ours = _params()
    first = CPUAdafactor(ours, weight_decay=0.01)
    _train(first, ours, range(2))
    theirs = torch.optim.Adafactor(ours, foreach=False, weight_decay=0.01)
    theirs.load_state_dict(first.state_dict())
    _train(theirs, ours, range(2, STEPS))
    # torch -> infinity
    back = _params()
    torch_first = torch.optim.Adafactor(back, foreach=False, weight_decay=0.01)
    _train(torch_first, back, range(2))
    second = CPUAdafactor(back, weight_decay=0.01)
    second.load_state_dict(torch_first.state_dict())
    _train(second, back, range(2, STEPS))
    for a, b, c in zip(whole, ours, back, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_cpu_adafactor_has_torch_adafactor_signature_and_defaults() -> None:
    ours = inspect.signature(CPUAdafactor.__init__).parameters
    theirs = inspect.signature(torch.optim.Adafactor.__init__).parameters
    assert list(ours) == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name
    p = [torch.nn.Parameter(torch.zeros(3))]
    group = {k: v for k, v in CPUAdafactor(p).param_groups[0].items() if k != "params"}
    ref = {k: v for k, v in torch.optim.Adafactor(p).param_groups[0].items() if k != "params"}
    assert group == ref


def test_cpu_adafactor_checks_its_hyper_parameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="Invalid lr"):
        CPUAdafactor(p, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta2_decay"):
        CPUAdafactor(p, beta2_decay=0.5)
    with pytest.raises(ValueError, match=r"Invalid eps\[0\]"):
        CPUAdafactor(p, eps=(-1.0, 1e-3))
    with pytest.raises(ValueError, match=r"eps=.* must be a pair"):
        CPUAdafactor(p, eps=(1e-3,))
    with pytest.raises(ValueError, match="Invalid d"):
        CPUAdafactor(p, d=0.5)
    with pytest.raises(TypeError, match="CPUAdafactor keeps fp32 master parameters"):
        CPUAdafactor([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
