"""The device updates' bf16 states (``infinity.optim.device_state``), against the NumPy
model of NOTE [bf16 stochastic rounding] (test_bf16_stochastic_rounding.py) and the host
kernels.

The rounding's random bits and stores are checked byte for byte against the NumPy
model; the updates against the host kernels with the same bf16 states: the fp32
values being rounded may differ in the last ulp (the host kernels fuse
multiply-adds), so a stored moment may differ by one bf16 step where that ulp
crosses a rounding threshold, and nowhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_bf16_stochastic_rounding import _bits, _key, _round

from infinity.optim import kernels
from infinity.optim.chunk_optimizer import StepViews
from infinity.optim.cpu_adam import ADAM, AdamHyperParams, adam_on_device
from infinity.optim.device_state import (
    DEVICE_STEP_ELEMS,
    ROUNDING_TEMPORARIES,
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


def test_bf16_state_may_be_homed_on_a_device_and_counts_its_rounding_scratch():
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs there
    for optimizer in (ADAM, LION, SGD):
        bf16 = optimizer.with_state_dtype("bf16")
        assert bf16.steps_on(gpu)
        rounding = ROUNDING_TEMPORARIES if optimizer is not SGD else 0  # SGD's: to nearest
        extra = (len(optimizer.state_slots) + rounding) * 4 * DEVICE_STEP_ELEMS
        scratch = bf16.device_step_scratch(1 << 30, gpu) - optimizer.device_step_scratch(
            1 << 30, gpu
        )
        assert scratch >= extra
    assert not ADAM.with_state_dtype("int8").steps_on(gpu)
