"""The fused Lion kernel against Lion written in torch ops, on every ISA and thread count.

The reference is the update of the paper (and of ``lion_pytorch``), operation by
operation in torch; a bf16 momentum must be one of the two bf16 neighbours of the
reference's (stochastic rounding), int8 is coded by the independent NumPy codec of
``q8_reference.py``. Every vector ISA and every
thread count must store the same bits as the scalar kernel on one thread.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import q8_reference as q8
import torch
from adam_reference import assert_same_bits, random_floats

from infinity.optim import kernels
from infinity.optim.lion import lion_step, q8_encode_signed

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
SIZES = (1, 7, 15, 17, 33, 255, 256, 257, 1000, 4099)
VECTOR_ISAS = [isa for isa in kernels.available_isas() if isa != "scalar"]
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (None, torch.bfloat16, torch.float16)


def reference(p, g, m, *, lr, beta1, beta2, weight_decay, grad_scale=1.0):
    """One Lion step in torch ops on fp32 copies: (parameters, momentum)."""
    p, m = p.clone(), m.float().clone()
    g = g.float() * grad_scale
    p.mul_(1 - lr * weight_decay)
    p.add_(m.mul(beta1).add(g, alpha=1 - beta1).sign_(), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    return p, m


def _inputs(n: int, seed: int, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 3.0).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 0.1
    return p, g, m


@pytest.mark.parametrize(("grad_dtype", "decay"), list(itertools.product(GRAD_DTYPES, (0.0, 0.1))))
def test_the_kernel_is_the_reference_update(grad_dtype, decay) -> None:
    for n in SIZES:
        p, g, m = _inputs(n, seed=n, grad_dtype=grad_dtype)
        hyper = {**HYPER, "weight_decay": decay}
        want_p, want_m = reference(p, g, m, grad_scale=0.5, **hyper)
        out = torch.empty(n, dtype=torch.bfloat16)
        lion_step(p, g, m, grad_scale=0.5, out16=out, **hyper)
        torch.testing.assert_close(p, want_p, rtol=1e-6, atol=0)
        torch.testing.assert_close(m, want_m, rtol=1e-6, atol=1e-12)
        assert torch.equal(out, p.to(torch.bfloat16))


def test_a_zero_or_nan_direction_moves_nothing_or_poisons() -> None:
    """sign(0) is 0 (zeros stay zero: a chunk's padding), NaN reaches the parameter."""
    p = torch.tensor([0.0, 1.0, 2.0, 3.0])
    g = torch.tensor([0.0, 0.0, float("nan"), float("inf")])
    m = torch.zeros(4)
    lion_step(p, g, m, lr=0.5, beta1=0.9, beta2=0.99)
    assert p[0].item() == 0.0 and p[1].item() == 1.0
    assert p[2].isnan() and p[3].item() == 2.5  # sign(inf) = 1, as torch.sign


@pytest.mark.parametrize("n", (1000, 4099))
def test_bf16_momentum_rounds_to_a_neighbour(n) -> None:
    """A bf16 momentum is rounded stochastically (its bytes: test_bf16_stochastic_rounding.py):
    the stored value is the reference's truncated to bf16 or one bf16 step further out."""
    p, g, m = _inputs(n, seed=3)
    stored = m.to(torch.bfloat16)
    want_p, want_m = reference(p, g, stored, **HYPER)
    lion_step(p, g, stored, **HYPER)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=0)
    bits = want_m.view(torch.int32).numpy().view(np.uint32)
    down = (bits >> 16).astype(np.int64)
    got = stored.view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    up = got == down + 1
    assert np.all((got == down) | (up & ((bits & 0xFFFF) != 0)))
    assert 0 < up.sum() < n  # rounded both ways


@pytest.mark.parametrize("n", (1, 255, 257, 1000, 4099))
def test_int8_momentum_matches_the_numpy_codec(n) -> None:
    p, g, m = _inputs(n, seed=5)
    blocks = -(-n // q8.QBLOCK)
    code, scale = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
    q8_encode_signed(m, code, scale)
    want_code, want_scale = q8.encode_signed(m.numpy())
    assert np.array_equal(code.numpy(), want_code) and np.array_equal(scale.numpy(), want_scale)
    decoded = torch.from_numpy(q8.decode(want_code, want_scale, signed=True))
    want_p, want_m = reference(p, g, decoded, **HYPER)
    lion_step(p, g, code, exp_avg_scale=scale, **HYPER)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=0)
    want_code, want_scale = q8.encode_signed(want_m.numpy())
    assert np.array_equal(scale.numpy(), want_scale)
    assert (code.numpy() != want_code).mean() < 1e-3  # a value on a rounding boundary, at most


def _run(inputs, state: str, out_dtype):
    p, g, m = (t.clone() for t in inputs)
    n, scale = p.numel(), None
    if state == "bf16":
        m = m.to(torch.bfloat16)
    elif state == "int8":
        code, scale = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // 256))
        q8_encode_signed(m, code, scale)
        m = code
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    lion_step(p, g, m, grad_scale=0.25, out16=out, exp_avg_scale=scale, **HYPER)
    return [t for t in (p, m, scale, out) if t is not None]


def _special_inputs(n: int, grad_dtype: torch.dtype, seed: int):
    p, g, m = _inputs(n, seed, torch.float32)
    for t, offset in ((p, 1), (g, 2), (m, 3)):  # every 97th value of any kind: NaN, inf, ...
        idx = torch.arange(offset % n, n, 97)
        t[idx] = random_floats(idx.numel(), seed=seed + offset)
    return p, g.to(grad_dtype), m


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        if x.dtype is torch.uint8:
            assert torch.equal(x, y)
        else:
            assert_same_bits(x, y)


COMBOS = list(itertools.product(GRAD_DTYPES, OUT_DTYPES, ("fp32", "bf16", "int8")))


@pytest.mark.skipif(not VECTOR_ISAS, reason="this CPU has no AVX2/AVX-512 (scalar only)")
@pytest.mark.parametrize(("grad_dtype", "out_dtype", "state"), COMBOS)
def test_vector_isas_store_the_scalar_bits(grad_dtype, out_dtype, state) -> None:
    for n in (1, 15, 17, 31, 33, 257, 1000):
        inputs = _special_inputs(n, grad_dtype, seed=n)
        kernels.force_isa("scalar")
        want = _run(inputs, state, out_dtype)
        for isa in VECTOR_ISAS:
            kernels.force_isa(isa)
            _same(_run(inputs, state, out_dtype), want)


@pytest.mark.parametrize("state", ("fp32", "bf16", "int8"))
def test_every_thread_count_stores_the_same_bits(state) -> None:
    inputs = _inputs(300_001, seed=9)
    kernels.set_num_threads(1)
    want = _run(inputs, state, torch.bfloat16)
    for threads in (2, 3):
        kernels.set_num_threads(threads)
        _same(_run(inputs, state, torch.bfloat16), want)


def test_arguments_are_checked_before_the_native_code() -> None:
    p, g, m = _inputs(16, seed=1)
    with pytest.raises(TypeError, match="master has dtype bfloat16"):
        lion_step(p.bfloat16(), g, m, **HYPER)
    with pytest.raises(ValueError, match="lion_step updates CPU tensors only"):
        lion_step(p.to("meta"), g, m, **HYPER)
    with pytest.raises(ValueError, match="exp_avg has 8 elements but master has 16"):
        lion_step(p, g, m[:8], **HYPER)
    overlap = "(master|exp_avg) and (master|exp_avg) overlap in memory; lion_step"
    with pytest.raises(ValueError, match=overlap):
        lion_step(p, g, p, **HYPER)
    with pytest.raises(ValueError, match="exp_avg_scale is required"):
        lion_step(p, g, torch.zeros(16, dtype=torch.uint8), **HYPER)
    with pytest.raises(ValueError, match="not contiguous"):
        lion_step(torch.zeros(16, 2)[:, 0], g, m, **HYPER)
    with pytest.raises(ValueError, match="beta1=1.0 must be < 1.0"):
        lion_step(p, g, m, **{**HYPER, "beta1": 1.0})
    with pytest.raises(ValueError, match="lr=nan must be finite"):
        lion_step(p, g, m, **{**HYPER, "lr": float("nan")})
    with pytest.raises(ValueError, match="1 - lr \\* weight_decay must be a finite fp32 value"):
        lion_step(p, g, m, **{**HYPER, "lr": 1e30, "weight_decay": 1e30})
