"""16-bit gradients in, 16-bit parameter copy out: kernels.adam_step against torch."""

from __future__ import annotations

import struct

import pytest
import torch
from adam_reference import assert_rel_close, assert_same_bits, random_floats, torch_reference

from infinity.optim import kernels

DTYPES = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# fp32 values whose rounding to 16 bits is easy to get wrong.
_CRAFTED_COMMON = [
    0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0, 3.14159265,
    _f32(0x7FC00000), _f32(0xFFC00001),  # quiet NaNs, both signs
    _f32(0x7F800001), _f32(0x7FA00000),  # signalling NaNs: low payload bits only
    _f32(0x00000001), _f32(0x80000001), _f32(0x007FFFFF), _f32(0x00400000),  # fp32 subnormals
    _f32(0x7F7FFFFF), _f32(0xFF7FFFFF),  # largest finite fp32
]  # fmt: skip
_CRAFTED = {
    torch.bfloat16: [
        *_CRAFTED_COMMON,
        _f32(0x3F808000), _f32(0xBF808000),  # 1 + 2^-8: tie, rounds down to even
        _f32(0x3F818000), _f32(0xBF818000),  # tie, rounds up to even
        _f32(0x3F807FFF), _f32(0x3F808001),  # just below / above a tie
        _f32(0x7F7F7FFF), _f32(0x7F7F8000),  # below / at the tie to infinity
        _f32(0x00008000), _f32(0x00018000),  # subnormal ties
        _f32(0x007FFFFF), _f32(0x00807FFF),  # rounds into / within the normal range
    ],
    torch.float16: [
        *_CRAFTED_COMMON,
        65504.0, 65519.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e10,  # largest half, overflow
        2.0**-14, 2.0**-24, -(2.0**-24), 2.0**-25, _f32(0x33000001), 3 * 2.0**-25,  # subnormals
        2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-24, 2.0**-26,  # ties at the subnormal/normal edge
        1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 3 * 2.0**-11), 1 + 2.0**-11 + 2.0**-20,  # ties
        2049.0, 2051.0, 4097.0,  # integer ties
    ],
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_16bit_grads_and_output_match_torch_on_upcast_grads(
    dtype: torch.dtype, adamw: bool
) -> None:
    n = 5003
    gen = torch.Generator().manual_seed(10)
    p0 = torch.randn(n, generator=gen)
    grads16 = [torch.randn(n, generator=gen).to(dtype) for _ in range(20)]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    (expected,), _ = torch_reference([p0], [[g.float()] for g in grads16], adamw=adamw, **hyper)

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    for step, g in enumerate(grads16, start=1):
        kernels.adam_step(
            p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
            weight_decay=0.1, adamw=adamw, out16=out,
        )  # fmt: skip
        assert_same_bits(out, p.to(dtype))
    assert_rel_close(p, expected)


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_every_16bit_gradient_value_is_read_exactly(dtype: torch.dtype, isa: str) -> None:
    kernels.force_isa(isa)
    # With beta1 = 0 the first moment after one step is exactly the gradient,
    # so exp_avg exposes the kernel's 16 -> 32 bit conversion of all 65536 values.
    g16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).clone()
    n = g16.numel()
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    kernels.adam_step(p, g16, m, v, step=1, lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8)
    g32 = g16.float()  # torch's conversion
    finite = g32.isfinite()
    assert_same_bits(m[finite], g32[finite])
    assert m[~finite].isnan().all()  # torch's lerp gives NaN there too: 0 * inf


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_16bit_output_rounds_like_torch_on_crafted_values(dtype: torch.dtype, isa: str) -> None:
    kernels.force_isa(isa)  # each ISA's conversion against torch's, not just against each other
    crafted = torch.tensor(_CRAFTED[dtype], dtype=torch.float32)
    in_range = torch.linspace(-70000.0, 70000.0, 4099)
    tiny = torch.linspace(-(2.0**-13), 2.0**-13, 4099)
    p0 = torch.cat([crafted, random_floats(1 << 18, seed=11), in_range, tiny])
    n = p0.numel()
    # lr = 0 and zero gradients leave the master weights bit-for-bit unchanged,
    # so the 16-bit output is the kernel's rounding of exactly these values.
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    kernels.adam_step(
        p, torch.zeros(n), m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, out16=out
    )
    assert_same_bits(p, p0)
    assert_same_bits(out, p0.to(dtype))
