"""The device updates' bf16 and int8 states (``infinity.optim.device_state``), against
the NumPy models of NOTE [bf16 stochastic rounding] (test_bf16_stochastic_rounding.py)
and of the int8 codes (q8_reference.py), and against the host kernels.

The rounding's random bits, the bf16 stores and the int8 codes are checked byte for
byte against the NumPy models; the updates against the host kernels with the same
states: the fp32 values being stored may differ in the last ulps (the host kernels
fuse multiply-adds), so a stored state may differ by one step of its format where
they cross a rounding threshold, and nowhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import q8_reference as q8
import torch
from test_bf16_stochastic_rounding import _bits, _key, _round

from infinity.optim import kernels
from infinity.optim.chunk_optimizer import StepViews
from infinity.optim.cpu_adam import ADAM, AdamHyperParams, adam_on_device
from infinity.optim.device_state import (
    CODING_TEMPORARIES,
    DEVICE_STEP_ELEMS,
    ROUNDING_TEMPORARIES,
    BlockStates,
    random_bits,
    round_key,
    store_bf16_stochastic,
)
from infinity.optim.lion import LION, LionHyperParams, lion_on_device, lion_step
from infinity.optim.sgd import SGD, SGDHyperParams, sgd_on_device, sgd_step

STREAMS = [(1, 0), (7, 3), (2**31 + 5, 2**40 + 9), (2**40, 2**63 + 11)]  # (step, stream)


@pytest.mark.parametrize(("step", "stream"), STREAMS)
def test_random_bits_are_the_host_kernels(step, stream):
    assert round_key(step, stream) == _key(step, stream)
    for offset in (0, 123, 2**32 - 5):  # the last wraps the index past 2^32
        ours = random_bits(round_key(step, stream), offset, 1000, torch.device("cpu"))
        assert np.array_equal(ours.numpy().astype(np.uint64), _bits(step, stream, offset, 1000))


def test_stochastic_store_is_the_host_kernels_bytes_for_every_kind_of_value():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.randn(4000, generator=g) * 10.0 ** torch.randint(-40, 38, (4000,), generator=g),
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                      3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.0, 2.0**-126]),
    ]).float()  # fmt: skip
    bits = _bits(3, 5, 17, x.numel())
    for r16 in (bits & 0xFFFF, bits >> 16):
        out = torch.empty(x.numel(), dtype=torch.bfloat16)
        store_bf16_stochastic(out, x, torch.from_numpy(r16.astype(np.int64)))
        want = _round(x, r16)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def _bf16_views(n: int, seed: int, slots: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    states = [(torch.rand(n, generator=g) * 1e-3).to(torch.bfloat16) for _ in slots]
    return master, grad, *states


def _close(ours: torch.Tensor, host: torch.Tensor) -> None:
    """Equal but where the fp32 values (a few ulps apart, more where an update cancels
    to about 0) round to different sides: there one bf16 step apart (or within the
    fp32 noise near 0), in at most 1% of the elements."""
    torch.testing.assert_close(ours.float(), host.float(), rtol=2**-7, atol=1e-7)
    assert int((ours.view(torch.int16) != host.view(torch.int16)).sum()) <= ours.numel() // 100


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_bf16_moments_on_the_device_are_the_host_kernels(adamw):
    """Over more than one block and several steps, the rounding told the same
    stream and offset as the host kernel (the second half of a chunk here)."""
    n = DEVICE_STEP_ELEMS + 1000
    hyper = AdamHyperParams(
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw
    )
    ours = _bf16_views(n, 0, ("exp_avg", "exp_avg_sq"))
    host = _bf16_views(n, 0, ("exp_avg", "exp_avg_sq"))
    for step in (1, 2, 3):
        views = StepViews(ours[0], ours[1], {"exp_avg": ours[2], "exp_avg_sq": ours[3]}, None,
                          rounding=(9, 4096))  # fmt: skip
        adam_on_device(views, hyper, step=step, grad_scale=0.5)
        kernels.adam_step(*host, step=step, grad_scale=0.5, round_stream=9, round_offset=4096,
                          **hyper.kernel_kwargs())  # fmt: skip
    torch.testing.assert_close(ours[0], host[0], rtol=1e-5, atol=1e-7)
    _close(ours[2], host[2])
    _close(ours[3], host[3])


def test_lion_bf16_momentum_on_the_device_is_the_host_kernels():
    n = DEVICE_STEP_ELEMS + 1000
    hyper = LionHyperParams(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    ours = _bf16_views(n, 1, ("exp_avg",))
    host = _bf16_views(n, 1, ("exp_avg",))
    for step in (1, 2, 3):
        views = StepViews(ours[0], ours[1], {"exp_avg": ours[2]}, None, rounding=(5, 0))
        lion_on_device(views, hyper, step=step, grad_scale=1.0)
        lion_step(*host, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, step=step,
                  round_stream=5, round_offset=0)  # fmt: skip
    assert (ours[0] != host[0]).sum() <= 2  # the sign of an interpolation at ~0
    _close(ours[2], host[2])


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_bf16_buffer_on_the_device_is_the_host_kernels(nesterov):
    """Rounded to nearest, as torch and the host kernel round it."""
    n = DEVICE_STEP_ELEMS + 1000
    hyper = SGDHyperParams(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01,
                           nesterov=nesterov, maximize=False)  # fmt: skip
    ours = _bf16_views(n, 2, ("momentum_buffer",))
    host = _bf16_views(n, 2, ("momentum_buffer",))
    for step in (1, 2, 3):
        views = StepViews(ours[0], ours[1], {"momentum_buffer": ours[2]}, None)
        sgd_on_device(views, hyper, first_step=step == 1, grad_scale=1.0)
        sgd_step(*host, lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01,
                 nesterov=nesterov, maximize=False, first_step=step == 1)  # fmt: skip
    torch.testing.assert_close(ours[0], host[0], rtol=1e-6, atol=1e-8)
    _close(ours[2], host[2])


def test_16_and_8_bit_states_may_be_homed_on_a_device_and_count_their_scratch():
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs there
    for optimizer in (ADAM, LION, SGD):
        for fmt in optimizer.state_dtypes[1:]:
            stored = optimizer.with_state_dtype(fmt)
            assert stored.steps_on(gpu)
            coding = CODING_TEMPORARIES if fmt == "int8" else ROUNDING_TEMPORARIES
            coding *= optimizer is not SGD  # SGD's buffer: bf16 to nearest
            extra = (len(optimizer.state_slots) + coding) * 4 * DEVICE_STEP_ELEMS
            fp32 = optimizer.device_step_scratch(1 << 30, gpu)
            assert stored.device_step_scratch(1 << 30, gpu) - fp32 >= extra


def _q8_moments(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 2, (n,), generator=g)
    v = m * m * torch.rand(n, generator=g) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)
    m[::97] = 0.0
    v[::89] = 0.0  # (its first moment codes to zero: NOTE [int8 second moment zero])
    v[-300:] = 0.0  # a whole block of zero second moments, then a partial one
    return m.numpy(), v.numpy()


def test_int8_codes_are_the_numpy_models_both_ways():
    """Encode fp32 moments (a partial last block) and decode them back, byte for byte."""
    n = 5 * 256 + 77
    m, v = _q8_moments(n, 0)
    m_code, m_scale, v_code, v_scale = q8.encode(m, v)
    state = {"exp_avg": torch.zeros(n, dtype=torch.uint8),
             "exp_avg_sq": torch.zeros(n, dtype=torch.uint8)}  # fmt: skip
    scales = {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}
    blocks = BlockStates(state, slice(0, n), scales=scales)
    blocks.store("exp_avg_sq", torch.from_numpy(v))
    blocks.store("exp_avg", torch.from_numpy(m), zero_where_zero="exp_avg_sq")
    assert np.array_equal(state["exp_avg"].numpy(), m_code)
    assert np.array_equal(state["exp_avg_sq"].numpy(), v_code)
    assert np.array_equal(scales["exp_avg"].numpy(), m_scale)
    assert np.array_equal(scales["exp_avg_sq"].numpy(), v_scale)
    again = BlockStates(state, slice(0, n), scales=scales)
    for name, signed, code, scale in (("exp_avg", True, m_code, m_scale),
                                      ("exp_avg_sq", False, v_code, v_scale)):  # fmt: skip
        decoded = again.load(name).numpy()
        assert np.array_equal(
            decoded.view(np.uint32), q8.decode(code, scale, signed).view(np.uint32)
        )


def _q8_views(n: int, seed: int, slots: tuple[str, ...]):
    """fp32 master, bf16 gradient, and int8 states (codes and scales) from encoded moments."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    m, v = _q8_moments(n, seed)
    m_code, m_scale, v_code, v_scale = q8.encode(m * 1e-2, v * 1e-4)
    codes = {"exp_avg": (m_code, m_scale), "exp_avg_sq": (v_code, v_scale)}
    return (
        master,
        grad,
        {
            s: (torch.from_numpy(codes[s][0].copy()), torch.from_numpy(codes[s][1].copy()))
            for s in slots
        },
    )


def _codes_close(ours: torch.Tensor, host: torch.Tensor) -> None:
    """Codes equal but where the value crossed a rounding threshold (one code apart,
    under 2% of them)."""
    a, b = ours.to(torch.int32), host.to(torch.int32)
    differ = a != b
    assert int(differ.sum()) <= ours.numel() // 50
    assert int(((a & 0x7F) - (b & 0x7F))[differ].abs().amax()) <= 1 if differ.any() else True


def test_adam_int8_moments_on_the_device_are_the_host_kernels():
    n = DEVICE_STEP_ELEMS + 1000  # two device blocks, the second ending in a partial QBLOCK
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    ours = _q8_views(n, 3, ("exp_avg", "exp_avg_sq"))
    host = _q8_views(n, 3, ("exp_avg", "exp_avg_sq"))
    for step in (1, 2, 3):
        (m, ms), (v, vs) = ours[2]["exp_avg"], ours[2]["exp_avg_sq"]
        views = StepViews(ours[0], ours[1], {"exp_avg": m, "exp_avg_sq": v}, None,
                          scales={"exp_avg": ms, "exp_avg_sq": vs})  # fmt: skip
        adam_on_device(views, hyper, step=step, grad_scale=0.5)
        (hm, hms), (hv, hvs) = host[2]["exp_avg"], host[2]["exp_avg_sq"]
        scales = {"exp_avg_scale": hms, "exp_avg_sq_scale": hvs}
        kernels.adam_step(host[0], host[1], hm, hv, step=step, grad_scale=0.5, **scales,
                          **hyper.kernel_kwargs())  # fmt: skip
    # a code one step apart (1/16 of its moment) moves the next update by ~1/16 of lr
    apart = ~torch.isclose(ours[0], host[0], rtol=1e-4, atol=1e-6)
    assert int(apart.sum()) <= n // 1000
    assert float((ours[0] - host[0]).abs().max()) <= 0.1 * hyper.lr
    for slot in ("exp_avg", "exp_avg_sq"):
        _codes_close(ours[2][slot][0], host[2][slot][0])
        torch.testing.assert_close(ours[2][slot][1], host[2][slot][1], rtol=1e-5, atol=0)


def test_lion_int8_momentum_on_the_device_is_the_host_kernels():
    n = DEVICE_STEP_ELEMS + 1000
    hyper = LionHyperParams(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    ours = _q8_views(n, 4, ("exp_avg",))
    host = _q8_views(n, 4, ("exp_avg",))
    for step in (1, 2, 3):
        m, ms = ours[2]["exp_avg"]
        views = StepViews(ours[0], ours[1], {"exp_avg": m}, None, scales={"exp_avg": ms})
        lion_on_device(views, hyper, step=step, grad_scale=1.0)
        hm, hms = host[2]["exp_avg"]
        lion_step(host[0], host[1], hm, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1,
                  exp_avg_scale=hms, step=step)  # fmt: skip
    assert (ours[0] != host[0]).sum() <= 2  # the sign of an interpolation at ~0
    _codes_close(ours[2]["exp_avg"][0], host[2]["exp_avg"][0])
    torch.testing.assert_close(ours[2]["exp_avg"][1], host[2]["exp_avg"][1], rtol=1e-5, atol=0)
