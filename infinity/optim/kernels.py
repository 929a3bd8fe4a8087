"""Low-level fused CPU Adam/AdamW step over flat buffers (the chunk engine's entry point).

One call updates fp32 master parameters and both moments in a single pass over
memory, reading gradients in fp32, bf16 or fp16, applying a gradient scale
factor, and optionally writing a bf16/fp16 copy of the updated parameters.
The native kernel (``infinity._C.adam``) is chosen at run time for the CPU
(AVX-512, AVX2+FMA+F16C, or portable scalar code) and runs on a small pool of
C++ threads with the GIL released. Results are bitwise identical for every
ISA and every thread count.

Every argument is validated here, in Python, with an error that names it: a
bad tensor never reaches the native code as a bad pointer.
"""

from __future__ import annotations

import math
import numbers
import operator
from types import ModuleType

import torch

from infinity._native import native

__all__ = [
    "active_isa",
    "adam_step",
    "available_isas",
    "default_num_threads",
    "force_isa",
    "get_num_threads",
    "set_num_threads",
]

# dtype codes of the native API (cpp/adam/adam_types.hpp, DType)
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {torch.bfloat16: 1, torch.float16: 2}
_FP32 = (torch.float32,)
_GRAD_DTYPES = tuple(_GRAD_CODES)
_OUT_DTYPES = tuple(_OUT_CODES)
_module: ModuleType | None = None


def _adam() -> ModuleType:
    """``infinity._C.adam``, looked up once (this sits on the per-chunk path)."""
    global _module
    if _module is None:
        _module = native().adam
    return _module


# NOTE: the checks below run on every call (the chunk engine calls once per
# chunk), so they use the cheapest tensor attributes: `is_cpu` instead of
# `device.type` (6x faster), identity tests, no allocations on the happy path.


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None) -> int:
    """Check one buffer; return its numel."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_cpu is not True:
        raise ValueError(
            f"{name} is on device '{t.device}'; adam_step updates CPU tensors only "
            "(move the buffers to CPU memory first)"
        )
    if t.layout is not torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; adam_step needs dense (strided) tensors")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {expected}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "adam_step treats buffers as flat memory, pass .contiguous() tensors"
        )
    n = t.numel()
    if numel is not None and n != numel:
        raise ValueError(
            f"{name} has {n} elements but master has {numel}; all buffers need the same numel"
        )
    return n


def _check_disjoint(buffers: tuple[tuple[str, torch.Tensor], ...]) -> None:
    end, previous = 0, ""
    for start, size, name in sorted([(t.data_ptr(), t.nbytes, name) for name, t in buffers]):
        if size:
            if start < end:
                raise ValueError(
                    f"{previous} and {name} overlap in memory; adam_step needs separate "
                    "buffers (it reads and writes them in one pass)"
                )
            end, previous = start + size, name


def _finite(
    name: str, value: object, *, low: float | None = None, high: float | None = None
) -> float:
    if type(value) is float:  # the common case, checked first
        x = value
    elif isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    elif isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TypeError(
            f"{name} must be a float or a 1-element tensor, got shape {tuple(value.shape)}"
        )
    else:
        x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name}={x} must be finite")
    if low is not None and x < low:
        raise ValueError(f"{name}={x} must be >= {low}")
    if high is not None and not x < high:
        raise ValueError(f"{name}={x} must be < {high}")
    return x


def adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
) -> None:
    """Apply one Adam or AdamW step in place, in one pass over the buffers.

    Per element, with ``g = grad * grad_scale`` (the scale folds loss-scale
    unscaling and grad-norm clipping into the same pass)::

        AdamW (adamw=True):   p = p * (1 - lr * weight_decay)       # decoupled decay
        Adam  (adamw=False):  g = g + weight_decay * p               # L2 penalty in the gradient
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
        out16 = bf16/fp16(p)   # round-to-nearest-even, if out16 is given

    The operations and their rounding follow ``torch.optim.AdamW`` (``Adam``)
    step for step; results match torch to a few ulps (FMA placement), and are
    bitwise identical across ISAs and thread counts.

    Args:
        master: fp32 master parameters, updated in place.
        grad: gradients, fp32, bf16 or fp16; only read.
        exp_avg, exp_avg_sq: fp32 first and second moments, updated in place.
        step: the 1-based step count *after* the increment (bias correction).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: decoupled weight decay (AdamW) if True, L2 (Adam) if False.
        grad_scale: factor applied to every gradient before the update.
        out16: optional bf16/fp16 buffer that receives the updated parameters.

    All buffers must be contiguous CPU tensors with the same number of
    elements (any shapes; they are treated as flat) that do not overlap.

    Raises:
        TypeError: a buffer is not a tensor or has the wrong dtype, or a
            hyper-parameter has the wrong type.
        ValueError: wrong device, layout, contiguity or size, overlapping
            buffers, ``step < 1``, or a hyper-parameter out of range.
    """
    n = _check_tensor("master", master, _FP32, None)
    _check_tensor("grad", grad, _GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, _FP32, n)
    _check_tensor("exp_avg_sq", exp_avg_sq, _FP32, n)
    buffers = (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    if out16 is not None:
        _check_tensor("out16", out16, _OUT_DTYPES, n)
        buffers += (("out16", out16),)
    _check_disjoint(buffers)

    if isinstance(step, bool):
        raise TypeError("step must be an int, got bool")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    if step < 1:
        raise ValueError(f"step={step} must be >= 1 (the step count after the increment)")
    lr = _finite("lr", lr, low=0.0)
    beta1 = _finite("beta1", beta1, low=0.0, high=1.0)
    beta2 = _finite("beta2", beta2, low=0.0, high=1.0)
    eps = _finite("eps", eps, low=0.0)
    weight_decay = _finite("weight_decay", weight_decay, low=0.0)
    grad_scale = _finite("grad_scale", grad_scale)
    if not isinstance(adamw, bool):
        raise TypeError(f"adamw must be a bool, got {type(adamw).__name__}")

    _adam().step(
        master.data_ptr(),
        grad.data_ptr(),
        _GRAD_CODES[grad.dtype],
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0 if out16 is None else out16.data_ptr(),
        0 if out16 is None else _OUT_CODES[out16.dtype],
        n,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adamw,
        grad_scale,
    )


def available_isas() -> list[str]:
    """ISAs this CPU can run the kernel with, widest first (the last is always ``"scalar"``)."""
    return list(_adam().available_isas())


def active_isa() -> str:
    """The ISA the next :func:`adam_step` uses: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return str(_adam().active_isa())


def force_isa(name: str | None) -> None:
    """Force the kernel's ISA to ``name`` (from :func:`available_isas`); ``None``: automatic.

    For tests and benchmarks: every ISA produces the same bits, only speed differs.
    """
    if name is not None:
        available = available_isas()
        if name not in available:
            raise ValueError(
                f"ISA {name!r} is not available on this CPU; available: {', '.join(available)}"
            )
    _adam().force_isa(name)


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the caller plus ``n - 1`` pool workers) for every following step."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    _adam().set_num_threads(n)


def get_num_threads() -> int:
    """Threads a step uses (default: :func:`default_num_threads`)."""
    return int(_adam().get_num_threads())


def default_num_threads() -> int:
    """Physical cores among the CPUs this process may use (``sched_getaffinity``), at most 64."""
    return int(_adam().default_num_threads())
