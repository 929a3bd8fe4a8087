"""Every ISA path and every thread count gives the same bits as the scalar, single-thread kernel.

The scalar kernel itself is checked against torch in the other test modules;
here the reference is the scalar path, and equality is bitwise (any NaN equals
any NaN: payloads may differ between instruction sets).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from adam_reference import assert_same_bits, random_floats

from infinity.optim import kernels

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
VECTOR_ISAS = [isa for isa in kernels.available_isas() if isa != "scalar"]


def _inputs(n: int, grad_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 3.0
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    # every 97th element of each buffer is a value of any kind: NaN, inf, subnormal, huge ...
    for t, seed_offset in ((p, 1), (g, 2), (m, 3), (v, 4)):
        idx = torch.arange(seed_offset % n, n, 97)
        t[idx] = random_floats(idx.numel(), seed=seed + seed_offset)
    return {"p": p, "g": g.to(grad_dtype), "m": m, "v": v}


def _run(
    inputs: dict[str, torch.Tensor], out_dtype: torch.dtype | None, adamw: bool
) -> list[torch.Tensor]:
    p, m, v = inputs["p"].clone(), inputs["m"].clone(), inputs["v"].clone()
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    kernels.adam_step(
        p, inputs["g"], m, v, step=7, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.02, adamw=adamw, grad_scale=0.5, out16=out,
    )  # fmt: skip
    return [p, m, v] + ([] if out is None else [out])


COMBOS = list(itertools.product(GRAD_DTYPES, OUT_DTYPES, [True, False]))
COMBO_IDS = [
    f"g{str(g)[6:]}-o{str(o)[6:] if o else 'none'}-{'adamw' if w else 'adam'}" for g, o, w in COMBOS
]


@pytest.mark.skipif(not VECTOR_ISAS, reason="this CPU has no AVX2/AVX-512 (scalar only)")
@pytest.mark.parametrize(("grad_dtype", "out_dtype", "adamw"), COMBOS, ids=COMBO_IDS)
def test_vector_isas_match_scalar_bitwise(grad_dtype, out_dtype, adamw) -> None:
    # sizes: tails of every length below the vector widths, and a multi-thread size
    for n in (1, 7, 15, 17, 63, 65, 100_003):
        inputs = _inputs(n, grad_dtype, seed=n)
        kernels.force_isa("scalar")
        assert kernels.active_isa() == "scalar"
        expected = _run(inputs, out_dtype, adamw)
        for isa in VECTOR_ISAS:
            kernels.force_isa(isa)
            assert kernels.active_isa() == isa
            for got, want in zip(_run(inputs, out_dtype, adamw), expected, strict=True):
                assert_same_bits(got, want)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_thread_counts_give_identical_bits(grad_dtype: torch.dtype) -> None:
    n = 3 * 2**16 + 13  # large enough to be split, not a multiple of any vector width
    inputs = _inputs(n, grad_dtype, seed=5)
    kernels.set_num_threads(1)
    expected = _run(inputs, torch.bfloat16, adamw=True)
    for threads in (2, 3, 5):
        kernels.set_num_threads(threads)
        assert kernels.get_num_threads() == threads
        for got, want in zip(_run(inputs, torch.bfloat16, adamw=True), expected, strict=True):
            bits = torch.int16 if got.element_size() == 2 else torch.int32
            assert torch.equal(got.view(bits), want.view(bits))  # NaN payloads too


def test_worker_threads_use_the_callers_denormal_mode() -> None:
    # Under torch.set_flush_denormal(True) (FTZ/DAZ in the caller's MXCSR)
    # subnormal inputs read as zero, so lr=0 turns subnormal parameters into
    # signed zeros; without it they pass through unchanged. Pool threads must
    # follow the caller's mode in both cases, also when they were started
    # before the caller changed it.
    n = 3 * 2**16 + 5
    p0 = torch.full((n,), 1e-40)
    p0[::2] = -1e-40
    signed_zeros = torch.zeros(n).copysign(p0)

    def run() -> torch.Tensor:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        kernels.adam_step(p, torch.zeros(n), m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
        return p

    kernels.set_num_threads(2)
    assert_same_bits(run(), p0)  # starts the pool's worker with denormals on
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert_same_bits(run(), signed_zeros)  # the same pool, now flushing
        kernels.set_num_threads(1)
        assert_same_bits(run(), signed_zeros)
    finally:
        torch.set_flush_denormal(False)
    assert_same_bits(run(), p0)


def test_isa_and_thread_controls() -> None:
    isas = kernels.available_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    assert kernels.active_isa() == isas[0]
    kernels.force_isa("scalar")
    assert kernels.active_isa() == "scalar"
    kernels.force_isa(None)
    assert kernels.active_isa() == isas[0]
    assert 1 <= kernels.default_num_threads() <= 64
    kernels.set_num_threads(3)
    assert kernels.get_num_threads() == 3


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_misaligned_output_gives_the_same_bits(out_dtype: torch.dtype) -> None:
    # Large aligned outputs take the streaming-store path, misaligned ones the
    # ordinary one; both must write exactly torch's rounding of the master.
    n = 2**17 + 3
    inputs = _inputs(n, torch.bfloat16, seed=6)
    aligned = torch.empty(n, dtype=out_dtype)
    misaligned = torch.empty(n + 1, dtype=out_dtype)[1:]  # 2 bytes off any vector boundary
    results = []
    for out in (aligned, misaligned):
        p, m, v = inputs["p"].clone(), inputs["m"].clone(), inputs["v"].clone()
        kernels.adam_step(
            p, inputs["g"], m, v, step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, out16=out
        )
        assert_same_bits(out, p.to(out_dtype))
        results.append(p)
    assert_same_bits(results[0], results[1])


def _isa_in_fresh_process(value: str) -> subprocess.CompletedProcess:
    code = (
        "import torch\n"
        "from infinity.optim import kernels as k\n"
        "p, g, m, v = (torch.ones(300) for _ in range(4))\n"
        "k.adam_step(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,\n"
        "            weight_decay=0.0, adamw=True)\n"
        "k.force_isa(None)\n"  # automatic again: still the environment's choice
        "print(k.active_isa(), float(p[0]))\n"
    )
    env = {**os.environ, "INFINITY_CPU_ISA": value}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_environment_chooses_the_isa_and_names_a_bad_choice() -> None:
    """INFINITY_CPU_ISA: the escape hatch for a CPU whose widest kernel misbehaves."""
    done = _isa_in_fresh_process("scalar")
    assert done.returncode == 0, done.stderr
    isa, value = done.stdout.split()
    assert isa == "scalar" and float(value) == pytest.approx(1 - 0.1, abs=1e-6)
    bad = _isa_in_fresh_process("avx1024")
    assert bad.returncode != 0
    assert "INFINITY_CPU_ISA='avx1024'" in bad.stderr and "scalar" in bad.stderr
