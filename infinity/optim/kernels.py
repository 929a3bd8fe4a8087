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

from collections.abc import Sequence
from typing import Any

import torch

from infinity._native import submodule
from infinity._native.adam import GRAD_CODES as _GRAD_CODES
from infinity._native.adam import OUT16_CODES as _OUT_CODES
from infinity.optim.kernel_args import (
    FP32,
    GRAD_DTYPES,
    OUT16_DTYPES,
    check_bool,
    check_flat_buffers,
    check_rounding,
    check_step,
    check_tensor,
    finite,
)

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
    round_stream: int = 0,
    round_offset: int = 0,
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
            bf16 (rounded stochastically on every store, see
            NOTE [bf16 stochastic rounding] in docs/NOTES.md), or uint8 int8 codes
            with one fp32 scale per 256 elements in ``exp_avg_scale`` /
            ``exp_avg_sq_scale`` (see ``cpp/simd/q8_codec.hpp``); both the same dtype.
            The update itself runs in fp32.
        step: the 1-based step count *after* the increment (bias correction).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: decoupled weight decay (AdamW) if True, L2 (Adam) if False.
        grad_scale: factor applied to every gradient before the update.
        out16: optional bf16/fp16 buffer that receives the updated parameters.
        round_stream, round_offset: bf16 moments only: element ``i`` of the
            buffers is element ``round_offset + i`` of the caller's stream
            ``round_stream`` (the engine: chunk index and offset in the chunk),
            which with ``step`` draws the random bits of its rounding. Stepping
            a buffer in pieces with matching offsets stores the same bytes as
            stepping it whole.

    All buffers must be contiguous CPU tensors with the same number of
    elements (any shapes; they are treated as flat) that do not overlap.

    Raises:
        TypeError: a buffer is not a tensor or has the wrong dtype, or a
            hyper-parameter has the wrong type.
        ValueError: wrong device, layout, contiguity or size, overlapping
            buffers, ``step < 1``, or a hyper-parameter out of range.
    """
    b = check_flat_buffers(
        "adam_step",
        master,
        grad,
        (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)),
        out16,
        scales=(("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)),
        int8_state="int8 (uint8) moments",
    )
    step = check_step("step", step)
    hyper = _check_hyper(lr, beta1, beta2, eps, weight_decay, adamw, grad_scale)
    submodule("adam").step(
        *b.leading_args(),
        step,
        *hyper,
        b.state_code,
        *b.scales,
        *check_rounding(round_stream, round_offset),
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
        step_list = [check_step("steps", steps)] * count
    else:
        if len(steps) != count:
            raise ValueError(f"steps has {len(steps)} entries but masters has {count}")
        step_list = [check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
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
            check_tensor(f"out16s[{i}]", out, OUT16_DTYPES, n, "masters")
            out_ptrs.append(out.data_ptr())
            out_codes.append(_OUT_CODES[out.dtype])
    # Overlaps are checked natively (sorting every buffer's address
    # range); it is pointer arithmetic only, nothing is dereferenced first.
    submodule("adam").step_many(
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


def _check_four(i: int, p: Any, g: Any, m: Any, v: Any) -> int:
    """Check tensor i of adam_step_many; return its numel.

    One combined test on the happy path (this runs once per parameter
    tensor per step); the detailed checks that name the culprit run only when
    it fails.
    """
    try:
        n = p.numel()
        if (
            p.is_cpu is True
            and g.is_cpu is True
            and m.is_cpu is True
            and v.is_cpu is True
            and p.dtype is _F32
            and m.dtype is _F32
            and v.dtype is _F32
            and g.dtype in GRAD_DTYPES
            and p.layout is _STRIDED
            and g.layout is _STRIDED
            and m.layout is _STRIDED
            and v.layout is _STRIDED
            and p.is_contiguous()
            and g.is_contiguous()
            and m.is_contiguous()
            and v.is_contiguous()
            and g.numel() == n
            and m.numel() == n
            and v.numel() == n
            and isinstance(p, torch.Tensor)
            and isinstance(g, torch.Tensor)
            and isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)
        ):
            return n
    except (AttributeError, TypeError):
        pass  # not tensors: the detailed checks below say which
    n = check_tensor(f"masters[{i}]", p, FP32, None)
    check_tensor(f"grads[{i}]", g, GRAD_DTYPES, n, "masters")
    check_tensor(f"exp_avgs[{i}]", m, FP32, n, "masters")
    check_tensor(f"exp_avg_sqs[{i}]", v, FP32, n, "masters")
    raise AssertionError("unreachable: the detailed checks must reject what the fast one did")


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
    adamw = check_bool("adamw", adamw)
    return (
        finite("lr", lr, low=0.0),
        finite("beta1", beta1, low=0.0, high=1.0),
        finite("beta2", beta2, low=0.0, high=1.0),
        finite("eps", eps, low=0.0),
        finite("weight_decay", weight_decay, low=0.0),
        adamw,
        finite("grad_scale", grad_scale),
    )


def available_isas() -> list[str]:
    """ISAs this CPU can run the kernel with, widest first (the last is always ``"scalar"``)."""
    return list(submodule("adam").available_isas())


def active_isa() -> str:
    """The ISA the next :func:`adam_step` uses: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return str(submodule("adam").active_isa())


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
    submodule("adam").force_isa(name)


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the caller plus ``n - 1`` pool workers) for every following step."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    submodule("adam").set_num_threads(n)


def get_num_threads() -> int:
    """Threads a step uses (default: :func:`default_num_threads`)."""
    return int(submodule("adam").get_num_threads())


def default_num_threads() -> int:
    """Physical cores among the CPUs this process may use (``sched_getaffinity``), at most 64."""
    return int(submodule("adam").default_num_threads())
