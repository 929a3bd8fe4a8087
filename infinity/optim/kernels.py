"""Low-level fused CPU Adam/AdamW step over flat buffers (the chunk engine's entry point).

One call updates fp32 master parameters and both moments in a single pass over
memory, reading gradients in fp32, bf16 or fp16, applying a gradient scale
factor, and optionally writing a bf16/fp16 copy of the updated parameters.
The native kernel (``infinity._C.adam``) is chosen at run time for the CPU
(AVX-512, AVX2+FMA+F16C, or portable scalar code) and runs on a small pool of
C++ threads with the GIL released. Results are bitwise identical for every
ISA and every thread count.

Every argument is validated here, in Python, with an error that names it: a
bad tensor never reaches the native code as a bad pointer
(see NOTE [raw pointers into native code] in docs/NOTES.md).
:func:`adam_step_many` does the same for a list of tensors in one call (what
:class:`infinity.optim.CPUAdam` uses for a param group).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from types import ModuleType

import torch

from infinity._native import native
from infinity._native.adam import GRAD_CODES as _GRAD_CODES
from infinity._native.adam import OUT16_CODES as _OUT_CODES
from infinity._native.adam import QBLOCK as _QBLOCK
from infinity._native.adam import STATE_FORMATS as _STATE_CODES

__all__ = [
    "active_isa",
    "adam_step",
    "adam_step_many",
    "available_isas",
    "default_num_threads",
    "force_isa",
    "get_num_threads",
    "set_num_threads",
]

_F32 = torch.float32
_STRIDED = torch.strided
_FP32 = (torch.float32,)
# The moments' storage dtype names the kernel's state format (int8 codes are bytes).
_STATE_OF_DTYPE = {
    torch.float32: _STATE_CODES["fp32"],
    torch.bfloat16: _STATE_CODES["bf16"],
    torch.uint8: _STATE_CODES["int8"],
}
_STATE_DTYPES = tuple(_STATE_OF_DTYPE)
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


def _check_tensor(
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None,
    reference: str = "master",
) -> int:
    """Check one buffer; return its numel (which must equal ``numel`` if given)."""
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
            f"{name} has {n} elements but {reference} has {numel}; all buffers need the same numel"
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
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
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
        exp_avg, exp_avg_sq: first and second moments, updated in place: fp32,
            bf16 (rounded to nearest even on every store), or uint8 int8 codes
            with one fp32 scale per 256 elements in ``exp_avg_scale`` /
            ``exp_avg_sq_scale`` (see ``cpp/adam/q8_codec.hpp``); both the same dtype.
            The update itself runs in fp32.
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
    _check_tensor("exp_avg", exp_avg, _STATE_DTYPES, n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n, "exp_avg")
    buffers = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    scale_ptrs = (0, 0)
    if exp_avg.dtype is torch.uint8:
        blocks = -(-n // _QBLOCK)
        for name, scale in (
            ("exp_avg_scale", exp_avg_scale),
            ("exp_avg_sq_scale", exp_avg_sq_scale),
        ):
            if scale is None:
                raise ValueError(f"{name} is required with int8 (uint8) moments")
            _check_tensor(name, scale, _FP32, blocks, f"{n} elements in blocks of {_QBLOCK}")
            buffers.append((name, scale))
        scale_ptrs = (exp_avg_scale.data_ptr(), exp_avg_sq_scale.data_ptr())  # type: ignore[union-attr]
    if out16 is not None:
        _check_tensor("out16", out16, _OUT_DTYPES, n)
        buffers.append(("out16", out16))
    _check_disjoint(tuple(buffers))

    step = _check_step("step", step)
    hyper = _check_hyper(lr, beta1, beta2, eps, weight_decay, adamw, grad_scale)
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
        *hyper,
        _STATE_OF_DTYPE[exp_avg.dtype],
        *scale_ptrs,
    )


def adam_step_many(
    masters: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    steps: int | Sequence[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    out16s: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """:func:`adam_step` over several tensors at once, in one native call.

    Tensor ``i`` is updated exactly (bitwise) as ``adam_step(masters[i],
    grads[i], exp_avgs[i], exp_avg_sqs[i], step=steps[i], ..., out16=out16s[i])``
    would, but all tensors share one dispatch to the thread pool and small
    tensors are packed into common tasks: what torch calls a multi-tensor
    (``foreach``/``fused``) step. ``steps`` is one int for all tensors or one
    per tensor; the other hyper-parameters are shared.

    Each tensor's buffers must not overlap each other (``ValueError`` naming
    the tensor's index). Buffers of *different* tensors may overlap (e.g. the
    same parameter twice); the tensors are then updated one after the other
    in list order, as a per-tensor loop would.
    """
    count = len(masters)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(seq) != count:
            raise ValueError(f"{name} has {len(seq)} tensors but masters has {count}")
    if out16s is not None and len(out16s) != count:
        raise ValueError(f"out16s has {len(out16s)} entries but masters has {count}")
    if not isinstance(steps, (list, tuple)):
        step_list = [_check_step("steps", steps)] * count
    else:
        if len(steps) != count:
            raise ValueError(f"steps has {len(steps)} entries but masters has {count}")
        step_list = [_check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
    hyper = _check_hyper(lr, beta1, beta2, eps, weight_decay, adamw, grad_scale)

    numels, grad_codes, out_ptrs, out_codes = [], [], [], []
    for i in range(count):
        n = _check_four(i, masters[i], grads[i], exp_avgs[i], exp_avg_sqs[i])
        numels.append(n)
        grad_codes.append(_GRAD_CODES[grads[i].dtype])
        out = None if out16s is None else out16s[i]
        if out is None:
            out_ptrs.append(0)
            out_codes.append(0)
        else:
            _check_tensor(f"out16s[{i}]", out, _OUT_DTYPES, n, "masters")
            out_ptrs.append(out.data_ptr())
            out_codes.append(_OUT_CODES[out.dtype])
    # NOTE: overlaps are checked natively (sorting every buffer's address
    # range); it is pointer arithmetic only, nothing is dereferenced first.
    _adam().step_many(
        [t.data_ptr() for t in masters],
        [t.data_ptr() for t in grads],
        grad_codes,
        [t.data_ptr() for t in exp_avgs],
        [t.data_ptr() for t in exp_avg_sqs],
        out_ptrs,
        out_codes,
        numels,
        step_list,
        *hyper,
    )


def _check_four(i: int, p: object, g: object, m: object, v: object) -> int:
    """Check tensor i of adam_step_many; return its numel.

    NOTE: one combined test on the happy path (this runs once per parameter
    tensor per step); the detailed checks that name the culprit run only when
    it fails.
    """
    try:
        n = p.numel()  # type: ignore[attr-defined]
        if (
            p.is_cpu is True  # type: ignore[attr-defined]
            and g.is_cpu is True  # type: ignore[attr-defined]
            and m.is_cpu is True  # type: ignore[attr-defined]
            and v.is_cpu is True  # type: ignore[attr-defined]
            and p.dtype is _F32  # type: ignore[attr-defined]
            and m.dtype is _F32  # type: ignore[attr-defined]
            and v.dtype is _F32  # type: ignore[attr-defined]
            and g.dtype in _GRAD_DTYPES  # type: ignore[attr-defined]
            and p.layout is _STRIDED  # type: ignore[attr-defined]
            and g.layout is _STRIDED  # type: ignore[attr-defined]
            and m.layout is _STRIDED  # type: ignore[attr-defined]
            and v.layout is _STRIDED  # type: ignore[attr-defined]
            and p.is_contiguous()  # type: ignore[attr-defined]
            and g.is_contiguous()  # type: ignore[attr-defined]
            and m.is_contiguous()  # type: ignore[attr-defined]
            and v.is_contiguous()  # type: ignore[attr-defined]
            and g.numel() == n  # type: ignore[attr-defined]
            and m.numel() == n  # type: ignore[attr-defined]
            and v.numel() == n  # type: ignore[attr-defined]
            and isinstance(p, torch.Tensor)
            and isinstance(g, torch.Tensor)
            and isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)
        ):
            return n
    except (AttributeError, TypeError):
        pass  # not tensors: the detailed checks below say which
    n = _check_tensor(f"masters[{i}]", p, _FP32, None)
    _check_tensor(f"grads[{i}]", g, _GRAD_DTYPES, n, "masters")
    _check_tensor(f"exp_avgs[{i}]", m, _FP32, n, "masters")
    _check_tensor(f"exp_avg_sqs[{i}]", v, _FP32, n, "masters")
    raise AssertionError("unreachable: the detailed checks must reject what the fast one did")


def _check_step(name: str, step: object) -> int:
    if isinstance(step, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(step).__name__}") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1 (the step count after the increment)")
    return value


def _check_hyper(
    lr: object,
    beta1: object,
    beta2: object,
    eps: object,
    weight_decay: object,
    adamw: object,
    grad_scale: object,
) -> tuple[float, float, float, float, float, bool, float]:
    """Validated hyper-parameters in the order of the native signature."""
    if not isinstance(adamw, bool):
        raise TypeError(f"adamw must be a bool, got {type(adamw).__name__}")
    return (
        _finite("lr", lr, low=0.0),
        _finite("beta1", beta1, low=0.0, high=1.0),
        _finite("beta2", beta2, low=0.0, high=1.0),
        _finite("eps", eps, low=0.0),
        _finite("weight_decay", weight_decay, low=0.0),
        adamw,
        _finite("grad_scale", grad_scale),
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
