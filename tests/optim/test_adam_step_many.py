"""kernels.adam_step_many: several tensors in one native call, against torch and adam_step."""

from __future__ import annotations

import re

import pytest
import torch
from adam_reference import assert_rel_close, assert_same_bits, torch_reference

from infinity.optim import kernels

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
# empty, tiny, around the vector widths, and large enough to be split across threads
SIZES = [0, 1, 63, 65, 1000, 100_003, 3 * 2**16 + 1]


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in SIZES]


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_many_tensors_match_torch_and_single_calls(adamw: bool) -> None:
    params0 = _tensors(0)
    grads = [_tensors(step + 1) for step in range(5)]
    torch_hyper = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    expected, _ = torch_reference(params0, grads, adamw=adamw, **torch_hyper)

    many = [p.clone() for p in params0]
    many_m = [torch.zeros_like(p) for p in params0]
    many_v = [torch.zeros_like(p) for p in params0]
    single = [p.clone() for p in params0]
    single_m = [torch.zeros_like(p) for p in params0]
    single_v = [torch.zeros_like(p) for p in params0]
    kernels.set_num_threads(2)
    for step, gs in enumerate(grads, start=1):
        kernels.adam_step_many(many, gs, many_m, many_v, steps=step, adamw=adamw, **HYPER)
        for p, g, m, v in zip(single, gs, single_m, single_v, strict=True):
            kernels.adam_step(p, g, m, v, step=step, adamw=adamw, **HYPER)
    for p, s, e in zip(many, single, expected, strict=True):
        assert_rel_close(p, e)
        assert_same_bits(p, s)  # packing and splitting never change a tensor's bits


def test_per_tensor_steps_and_16bit_io() -> None:
    params0 = _tensors(10)
    grads = [g.to(torch.bfloat16) for g in _tensors(11)]
    steps = [1, 7, 2, 30, 5, 3, 11]
    ms = [torch.rand(n) * 0.01 for n in SIZES]
    vs = [torch.rand(n) * 1e-4 for n in SIZES]
    outs = [torch.empty(n, dtype=torch.float16) if i % 2 else None for i, n in enumerate(SIZES)]
    ps = [p.clone() for p in params0]
    ms_many, vs_many = [m.clone() for m in ms], [v.clone() for v in vs]
    kernels.adam_step_many(ps, grads, ms_many, vs_many, steps=steps, out16s=outs, **HYPER)
    for i in range(len(SIZES)):
        # torch, from the same moments: a fresh AdamW whose state is set to step - 1
        ref = params0[i].clone()
        opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        ref.grad = grads[i].float()
        opt.state[ref] = {
            "step": torch.tensor(float(steps[i] - 1)),
            "exp_avg": ms[i].clone(),
            "exp_avg_sq": vs[i].clone(),
        }
        opt.step()
        assert_rel_close(ps[i], ref.detach())
        if outs[i] is not None:
            assert_same_bits(outs[i], ps[i].to(torch.float16))


def test_same_tensor_twice_is_stepped_twice_in_order_like_torch() -> None:
    n = 5000
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    (expected,), _ = torch_reference(
        [p0], [[g], [g]], adamw=True, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1
    )
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    kernels.adam_step_many([p, p], [g, g], [m, m], [v, v], steps=[1, 2], **HYPER)
    assert_rel_close(p, expected)


def test_bad_input_names_the_tensor() -> None:
    ps, gs = _tensors(0)[:3], _tensors(1)[:3]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    with pytest.raises(ValueError, match="grads has 2 tensors but masters has 3"):
        kernels.adam_step_many(ps, gs[:2], ms, vs, steps=1, **HYPER)
    with pytest.raises(ValueError, match="steps has 2 entries"):
        kernels.adam_step_many(ps, gs, ms, vs, steps=[1, 2], **HYPER)
    with pytest.raises(ValueError, match=re.escape("steps[1]=0 must be >= 1")):
        kernels.adam_step_many(ps, gs, ms, vs, steps=[1, 0, 1], **HYPER)
    bad = [ms[0], ms[1].double(), ms[2]]
    with pytest.raises(TypeError, match=re.escape("exp_avgs[1] has dtype float64")):
        kernels.adam_step_many(ps, gs, bad, vs, steps=1, **HYPER)
    short = [vs[0], vs[1], torch.zeros(vs[2].numel() + 1)]
    with pytest.raises(ValueError, match=re.escape("exp_avg_sqs[2] has 64 elements")):
        kernels.adam_step_many(ps, gs, ms, short, steps=1, **HYPER)
    # a tensor whose own buffers overlap: found natively, named by index
    aliased = [ms[0], ms[1], ps[2]]
    with pytest.raises(ValueError, match="tensor 2: master and exp_avg overlap"):
        kernels.adam_step_many(ps, gs, aliased, vs, steps=1, **HYPER)
