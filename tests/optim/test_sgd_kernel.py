"""The fused SGD kernel against ``torch.optim.SGD(foreach=False)``, on every ISA and thread count.

The reference is torch's own optimizer on fp32 tensors, stepped with the
gradient the kernel reads (upcast, times ``grad_scale``); a bf16 buffer is
torch's fp32 buffer rounded by torch's conversion after every step. Torch's
CPU ``add(a, b, alpha)`` is one fused multiply-add where its kernels use FMA
(AVX2, AVX-512), and the kernel then stores torch's bits; on other builds the
comparison allows one rounding. Every vector ISA and every thread count must
store the same bits as the scalar kernel on one thread.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from adam_reference import assert_same_bits, random_floats

from infinity.optim import kernels
from infinity.optim.sgd import sgd_step

SIZES = (1, 7, 15, 17, 33, 257, 1000)
ISAS = kernels.available_isas()
VECTOR_ISAS = [isa for isa in ISAS if isa != "scalar"]
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (None, torch.bfloat16, torch.float16)
# torch.optim.SGD's flags, and the gradient scale the engine folds in.
CASES = {
    "plain": dict(momentum=0.0),
    "plain+decay+maximize": dict(momentum=0.0, weight_decay=0.1, maximize=True),
    "momentum": dict(momentum=0.9),
    "dampening+decay": dict(momentum=0.8, dampening=0.3, weight_decay=0.01),
    "nesterov+decay": dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    "nesterov+maximize": dict(momentum=0.7, nesterov=True, maximize=True),
}
TORCH_FUSES = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
STEPS = 3
LR = 0.01


def _assert_matches_torch(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if TORCH_FUSES:
        assert_same_bits(actual, expected)
    else:  # torch without FMA rounds each product of add(alpha=) once more
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def _grads(n: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 3.0).to(dtype) for _ in range(STEPS)]


def reference(p, grads, *, buf_dtype, grad_scale, **hyper):
    """``STEPS`` steps of ``torch.optim.SGD(foreach=False)``: (parameters, buffer)."""
    p = p.clone()
    opt = torch.optim.SGD([p], lr=LR, foreach=False, **hyper)
    for g in grads:
        p.grad = g.float() * grad_scale
        opt.step()
        buf = opt.state[p].get("momentum_buffer")
        if buf is not None and buf_dtype is torch.bfloat16:
            buf.copy_(buf.to(torch.bfloat16))  # what a bf16 buffer keeps for the next step
    buf = opt.state[p].get("momentum_buffer")
    return p, None if buf is None else buf.to(buf_dtype)


def ours(p, grads, *, buf_dtype, grad_scale, out_dtype=None, **hyper):
    """``STEPS`` kernel steps: (parameters, buffer, 16-bit copy)."""
    p, buf = p.clone(), torch.zeros(p.numel(), dtype=buf_dtype)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for step, g in enumerate(grads, start=1):
        sgd_step(p, g, buf, lr=LR, first_step=step == 1, grad_scale=grad_scale, out16=out, **hyper)
    return p, buf, out


@pytest.mark.parametrize(("isa", "case"), list(itertools.product(ISAS, CASES)))
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_the_kernel_is_torch_sgd(isa, case, grad_dtype) -> None:
    kernels.force_isa(isa)
    hyper = CASES[case]
    for n, buf_dtype in itertools.product(SIZES, (torch.float32, torch.bfloat16)):
        p = torch.randn(n, generator=torch.Generator().manual_seed(n))
        grads = _grads(n, seed=n + 1, dtype=grad_dtype)
        scale = 0.5 if n % 2 else 1.0
        want_p, want_buf = reference(p, grads, buf_dtype=buf_dtype, grad_scale=scale, **hyper)
        got_p, got_buf, out = ours(
            p, grads, buf_dtype=buf_dtype, grad_scale=scale, out_dtype=torch.bfloat16, **hyper
        )
        _assert_matches_torch(got_p, want_p)
        if want_buf is None:  # momentum 0: the buffer is never touched
            assert not got_buf.any()
        else:
            _assert_matches_torch(got_buf, want_buf)
        assert out is not None and torch.equal(out, got_p.to(torch.bfloat16))


def test_momentum_zero_needs_no_buffer_and_zeros_stay_zeros() -> None:
    p, g = torch.zeros(300), torch.zeros(300)
    sgd_step(p, g, None, lr=0.1, weight_decay=0.1)
    sgd_step(p, g, torch.zeros(300), lr=0.1, momentum=0.9, nesterov=True, first_step=True)
    assert not p.any() and not p.signbit().any()  # a chunk's padding stays +0


def test_the_first_step_does_not_read_the_buffer() -> None:
    """torch starts the buffer as the gradient: whatever a new buffer held is overwritten."""
    p, g = torch.ones(40), torch.full((40,), 2.0)
    buf = torch.full((40,), float("nan"))
    sgd_step(p, g, buf, lr=0.25, momentum=0.9, dampening=0.5, first_step=True)
    assert torch.equal(buf, g) and torch.equal(p, torch.full((40,), 0.5))


def _special_inputs(n: int, grad_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p, g, buf = (torch.randn(n, generator=gen) for _ in range(3))
    for t, offset in ((p, 1), (g, 2), (buf, 3)):  # every 13th value of any kind: NaN, inf, ...
        idx = torch.arange(offset % n, n, 13)
        t[idx] = random_floats(idx.numel(), seed=seed + offset)
    return p, g.to(grad_dtype), buf


def _run(inputs, buf_dtype, out_dtype, hyper) -> list[torch.Tensor]:
    p, g, buf = (t.clone() for t in inputs)
    buf = buf.to(buf_dtype)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    sgd_step(p, g, buf, lr=LR, grad_scale=0.25, out16=out, **hyper)
    return [t for t in (p, buf, out) if t is not None]


COMBOS = list(itertools.product(GRAD_DTYPES, OUT_DTYPES, (torch.float32, torch.bfloat16)))
VARIANTS = [
    dict(momentum=0.0, weight_decay=0.1),
    dict(momentum=0.9, first_step=True, nesterov=True),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True),
    dict(momentum=0.9, nesterov=True, weight_decay=0.1),
]


@pytest.mark.skipif(not VECTOR_ISAS, reason="this CPU has no AVX2/AVX-512 (scalar only)")
@pytest.mark.parametrize(("grad_dtype", "out_dtype", "buf_dtype"), COMBOS)
def test_vector_isas_store_the_scalar_bits(grad_dtype, out_dtype, buf_dtype) -> None:
    for n, hyper in itertools.product((1, 15, 17, 31, 33, 257), VARIANTS):
        inputs = _special_inputs(n, grad_dtype, seed=n)
        kernels.force_isa("scalar")
        want = _run(inputs, buf_dtype, out_dtype, hyper)
        for isa in VECTOR_ISAS:
            kernels.force_isa(isa)
            for x, y in zip(_run(inputs, buf_dtype, out_dtype, hyper), want, strict=True):
                assert_same_bits(x, y)


@pytest.mark.parametrize("buf_dtype", (torch.float32, torch.bfloat16))
def test_every_thread_count_stores_the_same_bits(buf_dtype) -> None:
    inputs = _special_inputs(300_001, torch.bfloat16, seed=9)
    hyper = VARIANTS[2]
    kernels.set_num_threads(1)
    want = _run(inputs, buf_dtype, torch.bfloat16, hyper)
    for threads in (2, 3):
        kernels.set_num_threads(threads)
        for x, y in zip(_run(inputs, buf_dtype, torch.bfloat16, hyper), want, strict=True):
            assert_same_bits(x, y)


def test_arguments_are_checked_before_the_native_code() -> None:
    p, g, buf = torch.zeros(16), torch.zeros(16), torch.zeros(16)
    with pytest.raises(TypeError, match="master has dtype bfloat16"):
        sgd_step(p.bfloat16(), g, buf, lr=0.1)
    with pytest.raises(TypeError, match="grad has dtype int32"):
        sgd_step(p, g.int(), buf, lr=0.1)
    with pytest.raises(TypeError, match="momentum_buffer has dtype float16"):
        sgd_step(p, g, buf.half(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="sgd_step updates CPU tensors only"):
        sgd_step(p.to("meta"), g, buf, lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffer has 8 elements but master has 16"):
        sgd_step(p, g, buf[:8], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffer is required with momentum=0.9"):
        sgd_step(p, g, None, lr=0.1, momentum=0.9)
    overlap = "(master|momentum_buffer) and (master|momentum_buffer) overlap in memory; sgd_step"
    with pytest.raises(ValueError, match=overlap):
        sgd_step(p, g, p, lr=0.1, momentum=0.9)
    g16 = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="(grad|out16) and (grad|out16) overlap in memory"):
        sgd_step(p, g16, buf, lr=0.1, out16=g16)
    with pytest.raises(ValueError, match="not contiguous"):
        sgd_step(torch.zeros(16, 2)[:, 0], g, buf, lr=0.1)
    with pytest.raises(TypeError, match="out16 has dtype float32"):
        sgd_step(p, g, buf, lr=0.1, out16=torch.zeros(16))
    with pytest.raises(ValueError, match="lr=nan must be finite"):
        sgd_step(p, g, buf, lr=float("nan"))
    with pytest.raises(ValueError, match="momentum=-0.5 must be >= 0.0"):
        sgd_step(p, g, buf, lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="weight_decay=-1.0 must be >= 0.0"):
        sgd_step(p, g, buf, lr=0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="dampening=inf must be finite"):
        sgd_step(p, g, buf, lr=0.1, dampening=float("inf"))
    with pytest.raises(ValueError, match="sgd_step: hyper-parameters must be finite fp32 values"):
        sgd_step(p, g, buf, lr=1e39)  # finite as a double, but no float
    with pytest.raises(TypeError, match="grad_scale must be a float"):
        sgd_step(p, g, buf, lr=0.1, grad_scale="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        sgd_step(p, g, buf, lr=0.1, nesterov=1)  # type: ignore[arg-type]
    assert not p.any() and not buf.any()  # nothing ran


def test_the_native_code_checks_its_own_arguments() -> None:
    """The binding refuses a bad code or a missing buffer even if Python did not check."""
    from infinity._native import native

    p, g = torch.zeros(8), torch.zeros(8)
    step = native().sgd.step
    args = dict(out16=0, out_dtype=0, n=8, lr=0.1, dampening=0.0, weight_decay=0.0,
                nesterov=False, maximize=False, first_step=False, grad_scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="momentum != 0 needs a momentum_buffer"):
        step(p.data_ptr(), g.data_ptr(), 0, 0, 0, momentum=0.9, **args)
    with pytest.raises(ValueError, match="grad: dtype code must be"):
        step(p.data_ptr(), g.data_ptr(), 7, 0, 0, momentum=0.0, **args)
    with pytest.raises(ValueError, match="state format must be fp32 or bf16"):
        step(p.data_ptr(), g.data_ptr(), 0, g.data_ptr(), 2, momentum=0.9, **args)
    with pytest.raises(ValueError, match="master and grad overlap"):
        step(p.data_ptr(), p.data_ptr(), 0, 0, 0, momentum=0.0, **args)
