"""The dtype and probe codes Python reads from ``infinity._C.adam`` mean what they say.

Each exported code is passed straight to the native kernel with a buffer of
that dtype; the result is compared with ``torch.optim.AdamW`` on the same
gradients (and torch's own cast for the 16-bit copy), so swapped or stale
codes fail here, independently of ``infinity.optim.kernels``.
"""

from __future__ import annotations

import pytest
import torch
from adam_reference import assert_rel_close, assert_same_bits, torch_reference

from infinity import _C
from infinity._native import adam as contract
from infinity.optim import kernels

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
N = 1000


def _native_step(grad: torch.Tensor, grad_code: int, out16=None, out_code: int = 0):
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(N, generator=gen)
    start = master.clone()
    m, v = torch.zeros(N), torch.zeros(N)
    beta1, beta2 = HYPER["betas"]
    out_ptr = 0 if out16 is None else out16.data_ptr()
    _C.adam.step(master.data_ptr(), grad.data_ptr(), grad_code, m.data_ptr(), v.data_ptr(),
                 out_ptr, out_code, N, 1, HYPER["lr"], beta1, beta2, HYPER["eps"],
                 HYPER["weight_decay"], True, 1.0)  # fmt: skip
    return start, master


def test_python_reads_the_native_codes():
    names = {str(d).removeprefix("torch."): c for d, c in contract.GRAD_CODES.items()}
    assert names == dict(_C.adam.dtype_codes)
    assert set(names) == {"float32", "bfloat16", "float16"}
    out = {str(d).removeprefix("torch."): c for d, c in contract.OUT16_CODES.items()}
    assert out == dict(_C.adam.out16_dtype_codes)
    assert set(out) == {"bfloat16", "float16"}
    assert kernels._GRAD_CODES is contract.GRAD_CODES
    assert kernels._OUT_CODES is contract.OUT16_CODES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_code_reads_its_dtype(dtype):
    grad = torch.randn(N, generator=torch.Generator().manual_seed(4)).to(dtype)
    start, master = _native_step(grad, contract.GRAD_CODES[dtype])
    (expected,), _ = torch_reference([start], [[grad.float()]], adamw=True, **HYPER)
    assert_rel_close(master, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out16_code_writes_its_dtype(dtype):
    grad = torch.randn(N, generator=torch.Generator().manual_seed(5))
    out16 = torch.empty(N, dtype=dtype)
    _, master = _native_step(grad, contract.GRAD_CODES[torch.float32], out16,
                             contract.OUT16_CODES[dtype])  # fmt: skip
    assert_same_bits(out16, master.to(dtype))


def test_codes_outside_the_contract_are_refused_natively():
    bad = max(contract.GRAD_CODES.values()) + 1
    with pytest.raises(ValueError, match="dtype code must be 0 \\(fp32\\), 1 \\(bf16\\) or 2"):
        _native_step(torch.zeros(N), bad)
    with pytest.raises(ValueError, match="out16 dtype must be bf16 or fp16"):
        _native_step(torch.zeros(N), 0, torch.empty(N), contract.GRAD_CODES[torch.float32])


def test_bandwidth_codes_move_the_bytes_their_names_say():
    n = 4096
    a, b, c, d = (torch.ones(n) for _ in range(4))
    ptrs = [t.data_ptr() for t in (a, b, c, d)]
    per_element = {"triad": 12, "axpy": 12, "adam_pattern": 28, "adam_prefetch": 28}
    assert set(contract.BANDWIDTH_KERNELS) == set(per_element)
    for name, code in contract.BANDWIDTH_KERNELS.items():
        assert _C.adam.bandwidth_probe(code, *ptrs, n) == per_element[name] * n, name
    with pytest.raises(ValueError, match="unknown kernel"):
        _C.adam.bandwidth_probe(max(contract.BANDWIDTH_KERNELS.values()) + 1, *ptrs, n)
