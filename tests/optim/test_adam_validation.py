"""Bad input to kernels.adam_step and CPUAdam raises a clear error naming the culprit."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

from infinity.optim import CPUAdam, kernels

N = 37
HYPER = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def _buffers(n: int = N) -> dict[str, torch.Tensor]:
    return {
        "master": torch.randn(n),
        "grad": torch.randn(n),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
    }


def _call(**overrides) -> None:
    args = {**_buffers(), **HYPER, **overrides}
    kernels.adam_step(
        args.pop("master"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), **args
    )


def test_valid_call_updates_in_place() -> None:
    b = _buffers()
    before = b["master"].clone()
    kernels.adam_step(b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"], **HYPER)
    assert not torch.equal(b["master"], before)


def test_empty_buffers_are_a_no_op() -> None:
    b = _buffers(0)
    kernels.adam_step(b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"], **HYPER)


@pytest.mark.parametrize(
    ("name", "value", "error", "pattern"),
    [
        ("master", torch.zeros(N, dtype=torch.float64), TypeError, "master has dtype float64"),
        ("master", torch.zeros(N, dtype=torch.bfloat16), TypeError, "master has dtype bfloat16"),
        ("grad", torch.zeros(N, dtype=torch.int32), TypeError, "grad has dtype int32"),
        ("exp_avg", torch.zeros(N, dtype=torch.float16), TypeError, "exp_avg has dtype float16"),
        ("out16", torch.zeros(N), TypeError, "out16 has dtype float32"),
        ("exp_avg_sq", [0.0] * N, TypeError, "exp_avg_sq must be a torch.Tensor"),
        ("grad", torch.zeros(N + 1), ValueError, "grad has 38 elements but master has 37"),
        ("out16", torch.zeros(N - 1, dtype=torch.bfloat16), ValueError, "out16 has 36 elements"),
        ("exp_avg", torch.zeros(2 * N)[::2], ValueError, "exp_avg is not contiguous"),
        ("master", torch.zeros(N, device="meta"), ValueError, "master is on device 'meta'"),
        ("grad", torch.zeros(N).to_sparse(), ValueError, "grad has layout torch.sparse_coo"),
    ],
)
def test_bad_buffers(name: str, value, error: type, pattern: str) -> None:
    with pytest.raises(error, match=re.escape(pattern)):
        _call(**{name: value})


def test_cuda_tensor_is_rejected_by_the_device_check() -> None:
    # No GPU needed: a tensor that reports a CUDA device must be refused before
    # its (invalid on the host) pointer could reach the native code.
    fake = mock.MagicMock(spec=torch.Tensor)
    fake.device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=re.escape("grad is on device 'cuda:0'")):
        _call(grad=fake)
    fake.data_ptr.assert_not_called()


@pytest.mark.parametrize(
    ("a", "b"),
    [("master", "grad"), ("exp_avg", "exp_avg_sq"), ("master", "exp_avg_sq"), ("grad", "out16")],
)
def test_overlapping_buffers_are_rejected(a: str, b: str) -> None:
    storage = torch.zeros(4 * N)
    bufs = _buffers()
    bufs[a] = storage[:N]
    bufs[b] = storage[N // 2 : N // 2 + N]  # partial overlap
    if b == "out16":
        bufs[b] = storage.view(torch.bfloat16)[N : 2 * N]  # the bytes of storage[N//2 : N]
    with pytest.raises(
        ValueError, match=f"{a} and {b} overlap in memory|{b} and {a} overlap in memory"
    ):
        _call(**bufs)


def test_same_tensor_twice_is_rejected() -> None:
    b = _buffers()
    with pytest.raises(ValueError, match="overlap"):
        kernels.adam_step(b["master"], b["grad"], b["exp_avg"], b["exp_avg"], **HYPER)


@pytest.mark.parametrize(
    ("name", "value", "error", "pattern"),
    [
        ("step", 0, ValueError, "step=0 must be >= 1"),
        ("step", -3, ValueError, "step=-3 must be >= 1"),
        ("step", 1.5, TypeError, "step must be an int"),
        ("step", True, TypeError, "step must be an int, got bool"),
        ("lr", float("nan"), ValueError, "lr=nan must be finite"),
        ("lr", -1e-3, ValueError, "lr=-0.001 must be >= 0"),
        ("beta1", 1.0, ValueError, "beta1=1.0 must be < 1"),
        ("beta2", -0.1, ValueError, "beta2=-0.1 must be >= 0"),
        ("eps", float("inf"), ValueError, "eps=inf must be finite"),
        ("weight_decay", -0.5, ValueError, "weight_decay=-0.5 must be >= 0"),
        ("grad_scale", float("inf"), ValueError, "grad_scale=inf must be finite"),
        ("grad_scale", "2", TypeError, "grad_scale must be a float"),
        ("adamw", 1, TypeError, "adamw must be a bool"),
    ],
)
def test_bad_hyper_parameters(name: str, value, error: type, pattern: str) -> None:
    with pytest.raises(error, match=re.escape(pattern)):
        _call(**{name: value})


def test_kernel_controls_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="ISA 'sse9' is not available"):
        kernels.force_isa("sse9")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            kernels.set_num_threads(bad)


# ---- CPUAdam ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_adam_rejects_16bit_params_with_advice(dtype: torch.dtype) -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with pytest.raises(TypeError, match=r"fp32 master parameters.*infinity\.offload"):
        CPUAdam([p])


def test_cpu_adam_rejects_other_dtypes_and_devices() -> None:
    with pytest.raises(TypeError, match=r"fp32 parameters only.*float64"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="is on 'meta'"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, device="meta"))])


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable", "differentiable"])
def test_cpu_adam_rejects_unsupported_torch_flags(flag: str) -> None:
    with pytest.raises(ValueError, match=f"CPUAdam does not implement {flag}=True"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **{flag: True})


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": -1.0}, "Invalid lr"),
        ({"betas": (1.0, 0.999)}, r"Invalid betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"Invalid betas\[1\]"),
        ({"eps": -1e-8}, "Invalid eps"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"lr": float("nan")}, "Invalid lr"),
    ],
)
def test_cpu_adam_rejects_bad_hyper_parameters(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_cpu_adam_rejects_bad_hyper_parameters_set_between_steps() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = CPUAdam([p])
    p.grad = torch.ones(3)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid lr"):
        opt.step()


def test_cpu_adam_rejects_sparse_gradients() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = CPUAdam([p])
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


def test_cpu_adam_checks_groups_added_later() -> None:
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="is on 'meta'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]})
    with pytest.raises(ValueError, match="Invalid eps"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], "eps": -1.0})


def test_cpu_adam_rejects_a_checkpoint_with_missized_moments_without_side_effects() -> None:
    p = torch.nn.Parameter(torch.ones(8))
    opt = CPUAdam([p], lr=0.1)
    p.grad = torch.ones(8)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(5)  # torch's load_state_dict does not check sizes
    opt.load_state_dict(sd)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="has 5 elements"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"].item() == 1
