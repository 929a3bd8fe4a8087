"""bf16 and int8 moments in the fused kernel, against independent references.

int8: the codec (``q8_reference.py``, a float64 code table searched for the
nearest entry) and one AdamW step computed in float64 by NumPy from the
decoded moments. bf16: the same step, each moment within one bf16 ulp (stochastic
rounding; its bytes are checked in ``test_bf16_stochastic_rounding.py``). Every ISA
is checked against the references, and all ISAs and thread counts must store
the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import q8_reference as ref
import torch

from infinity.optim import kernels
from infinity.optim.chunk_optimizer import StoredSlot, read_moments, write_moments

ISAS = kernels.available_isas()
SIZES = (1, 7, 17, 255, 256, 257, 1000, 4099)
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _moments(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Moments over many magnitudes, with zeros, a zero block and huge values."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)
    m = (0.3 * g + rng.standard_normal(n) * 1e-4).astype(np.float32)
    v = (g * g * rng.uniform(0.5, 2, n) + 1e-12).astype(np.float32)
    m[::13] = 0.0
    m[1::29] = -0.0
    v[::31] = 0.0
    if n > 600:
        m[256:512] = 0.0
        v[256:512] = 0.0
        m[600], v[600] = 3e30, 1e38
    return m, v


def _stored(m: np.ndarray, v: np.ndarray) -> tuple[StoredSlot, StoredSlot]:
    n, blocks = len(m), -(-len(m) // ref.QBLOCK)
    slots = tuple(StoredSlot(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)) for _ in "mv")
    write_moments(slots[0], slots[1], torch.from_numpy(m), torch.from_numpy(v))
    return slots[0], slots[1]


@pytest.mark.parametrize("n", SIZES)
def test_codec_matches_reference_exactly(n: int) -> None:
    m, v = _moments(n, seed=n)
    sm, sv = _stored(m, v)
    m_code, m_scale, v_code, v_scale = ref.encode(m, v)
    assert np.array_equal(sm.data.numpy(), m_code)
    assert np.array_equal(sv.data.numpy(), v_code)
    assert np.array_equal(sm.scale.numpy(), m_scale)
    assert np.array_equal(sv.scale.numpy(), v_scale)
    dm, dv = read_moments(sm, sv)
    assert np.array_equal(dm.numpy(), ref.decode(m_code, m_scale, signed=True))
    assert np.array_equal(dv.numpy(), ref.decode(v_code, v_scale, signed=False))


def test_codec_resolution() -> None:
    """Values above the subnormal codes of their block come back within 1/16 (3 fraction
    bits); a second moment below the range zeroes its first moment (docs/NOTES.md: int8
    second moment zero)."""
    m, v = _moments(4096, seed=1)
    dm, dv = read_moments(*_stored(m, v))
    assert np.all(dm.numpy()[dv.numpy() == 0] == 0)
    for x, d, lo in ((m, dm.numpy(), 2.0**-14), (v, dv.numpy(), 2.0**-30)):
        blockmax = np.repeat(np.abs(x).reshape(-1, ref.QBLOCK).max(1), ref.QBLOCK)
        big = (np.abs(x) >= blockmax * lo) & (dv.numpy() > 0)
        big &= np.abs(x) < 1e29  # the huge outlier's block is checked through the others
        assert np.all(np.abs(d[big] - x[big]) <= np.abs(x[big]) / 16 + 1e-45)


def _reference_step(p, g, m, v, step):
    """One AdamW step in float64 from fp32 inputs."""
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    lr, b1, b2, eps, wd = (HYPER[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    den = np.sqrt(v) / np.sqrt(1 - b2**step) + eps
    return p - lr / (1 - b1**step) * m / den, m, v


@pytest.mark.parametrize("isa", ISAS)
def test_int8_step_matches_reference(isa: str) -> None:
    kernels.force_isa(isa)
    for n in SIZES:
        m, v = _moments(n, seed=100 + n)
        sm, sv = _stored(m, v)
        m0, v0 = (t.numpy().astype(np.float64) for t in read_moments(sm, sv))
        rng = np.random.default_rng(n)
        p = rng.standard_normal(n).astype(np.float32)
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        pt = torch.from_numpy(p.copy())
        kernels.adam_step(
            pt, torch.from_numpy(g), sm.data, sv.data, step=5, **HYPER,
            exp_avg_scale=sm.scale, exp_avg_sq_scale=sv.scale,
        )  # fmt: skip
        p1, m1, v1 = _reference_step(p, g, m0, v0, step=5)
        # parameters: from the decoded moments, in fp32 (a few ulps from float64)
        live = m0 != 0  # an element with m == 0 and v == 0 takes Adam's first step
        np.testing.assert_allclose(pt.numpy()[live], p1[live], rtol=2e-6, atol=1e-7)
        # stored moments: the reference's own encoding of its updated moments, up to one
        # code where fp32 and float64 round either side of a midpoint
        m_code, m_scale, v_code, v_scale = ref.encode(m1.astype(np.float32), v1.astype(np.float32))
        np.testing.assert_allclose(sm.scale.numpy(), m_scale, rtol=1e-6)
        np.testing.assert_allclose(sv.scale.numpy(), v_scale, rtol=1e-6)
        for got, want in ((sm.data.numpy(), m_code), (sv.data.numpy(), v_code)):
            diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
            near = (diff <= 1) | ((got & 0x7F) <= 1) & ((want & 0x7F) <= 1)
            assert near.all(), f"n={n}: codes differ by more than one step"
            assert (diff == 0).mean() > 0.99


def _int8_run(n: int, isa: str, threads: int) -> list[torch.Tensor]:
    kernels.force_isa(isa)
    kernels.set_num_threads(threads)
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    blocks = -(-n // ref.QBLOCK)
    codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(blocks) for _ in range(2)]
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        kernels.adam_step(
            p, g, codes[0], codes[1], step=step, **HYPER, grad_scale=0.5, out16=out,
            exp_avg_scale=scales[0], exp_avg_sq_scale=scales[1],
        )  # fmt: skip
    return [p, out, *codes, *scales]


def test_int8_every_isa_and_thread_count_stores_the_same_bytes() -> None:
    for n in (1, 15, 17, 257, 70_001):
        expected = _int8_run(n, "scalar", 1)
        for isa in ISAS:
            for threads in (1, 2):
                got = _int8_run(n, isa, threads)
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (n, isa, threads)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_step_rounds_to_a_neighbour_of_the_reference(isa: str) -> None:
    """bf16 moments are rounded stochastically (``test_bf16_stochastic_rounding.py``
    checks the bytes): each stored moment is one of the two bf16 neighbours of the
    float64 step's, so within one bf16 ulp of it, and rounded both ways."""
    kernels.force_isa(isa)
    ups = downs = 0
    for n in SIZES:
        gen = torch.Generator().manual_seed(n)
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen) * 1e-2
        m = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
        v = (torch.rand(n, generator=gen) * 1e-4).to(torch.bfloat16)
        v[::7] = 0
        p1, m1, v1 = _reference_step(p.numpy(), g.numpy(), m.float().numpy(), v.float().numpy(), 3)
        pt, mt, vt = p.clone(), m.clone(), v.clone()
        kernels.adam_step(pt, g, mt, vt, step=3, **HYPER)
        np.testing.assert_allclose(pt.numpy(), p1, rtol=2e-6, atol=1e-7)
        for got, want in ((mt, m1), (vt, v1)):
            stored = got.double().numpy()
            ulp = np.ldexp(1.0, np.frexp(want)[1] - 8)  # bf16: 8 significant bits
            assert np.all(np.abs(stored - want) <= ulp * 1.001)
            ups += int(np.sum(np.abs(stored) > np.abs(want)))
            downs += int(np.sum(np.abs(stored) < np.abs(want)))
    assert ups > 1000 and downs > 1000, (ups, downs)


def test_int8_needs_scales_and_matching_dtypes() -> None:
    p, g = torch.zeros(300), torch.zeros(300)
    codes = torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(ValueError, match="exp_avg_scale is required"):
        kernels.adam_step(p, g, codes, codes.clone(), step=1, **HYPER)
    with pytest.raises(ValueError, match="exp_avg_sq_scale has 1 elements"):
        kernels.adam_step(
            p, g, codes, codes.clone(), step=1, **HYPER,
            exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(1),
        )  # fmt: skip
    with pytest.raises(TypeError, match="exp_avg_sq has dtype float32"):
        kernels.adam_step(p, g, codes, torch.zeros(300), step=1, **HYPER)


@pytest.mark.parametrize(("beta2", "bound"), [(0.95, 0.03), (0.999, 0.30)])
def test_int8_second_moment_follows_its_ema_over_many_steps(beta2: float, bound: float) -> None:
    """Issue 26's question: does nearest rounding freeze the int8 second moment?

    The reference is the EMA ``v = beta2 v + (1 - beta2) g^2`` in float64 over the same
    gradients (noise of two decades of scale within each block). At beta2 = 0.95 a
    step moves v by more than half a code (3-6%) often enough that v tracks its EMA
    (measured: within 1%); at 0.999 (0.1% a step) decreases round away more often
    than increases and v settles above its EMA (measured: +21% mean, steps 3.5%
    smaller, no growth after ~3000 steps). The bounds are the measured values with
    room; a codec that froze v would leave it far outside them.
    """
    n, steps = ref.QBLOCK * 16, 2000 if beta2 == 0.999 else 600
    gen = torch.Generator().manual_seed(0)
    scale = 10 ** (torch.rand(n, generator=gen) * 2 - 1)
    p = torch.zeros(n)
    codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(n // ref.QBLOCK) for _ in range(2)]
    ema = np.zeros(n)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * scale
        kernels.adam_step(
            p, g, codes[0], codes[1], step=step, lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8,
            weight_decay=0.0, exp_avg_scale=scales[0], exp_avg_sq_scale=scales[1],
        )  # fmt: skip
        ema = beta2 * ema + (1 - beta2) * g.double().numpy() ** 2
    _, v = read_moments(StoredSlot(codes[0], scales[0]), StoredSlot(codes[1], scales[1]))
    ratio = v.double().numpy() / ema
    assert abs(ratio.mean() - 1) < bound, ratio.mean()
