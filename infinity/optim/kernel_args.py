"""Argument checks shared by the fused CPU kernels' entry points (Adam:
:mod:`infinity.optim.kernels`, Lion: :func:`infinity.optim.lion.lion_step`, SGD:
:func:`infinity.optim.sgd.sgd_step`).

Every argument is validated in Python with an error that names it, so a bad
tensor never reaches the native code as a bad pointer
(see NOTE [raw pointers into native code] in docs/NOTES.md).
:func:`check_flat_buffers` checks the buffers of one flat step (master, grad,
the optimizer's states, their int8 block scales, the 16-bit copy) the same way
for every kernel; each wrapper passes its own names.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import torch

from infinity._native.adam import GRAD_CODES, OUT16_CODES, QBLOCK, STATE_FORMATS

FP32 = (torch.float32,)
GRAD_DTYPES = tuple(GRAD_CODES)
OUT16_DTYPES = tuple(OUT16_CODES)
STATE_OF_DTYPE: Mapping[torch.dtype, int] = {
    torch.float32: STATE_FORMATS["fp32"],
    torch.bfloat16: STATE_FORMATS["bf16"],
    torch.uint8: STATE_FORMATS["int8"],  # int8 codes are stored as bytes
}
"""The kernels' state-format code of each storage dtype of an optimizer state."""
_FP32_STATE = STATE_FORMATS["fp32"]

# The checks below run on every call (the chunk engine calls once per
# chunk), so they use the cheapest tensor attributes: `is_cpu` instead of
# `device.type` (6x faster), identity tests, no allocations on the happy path.


def check_tensor(
    name: str,
    t: object,
    dtypes: Collection[torch.dtype],
    numel: int | None,
    reference: str = "master",
    fn: str = "adam_step",
) -> int:
    """Check one buffer of kernel ``fn``; return its numel (which must equal ``numel``
    if given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_cpu is not True:
        raise ValueError(
            f"{name} is on device '{t.device}'; {fn} updates CPU tensors only "
            "(move the buffers to CPU memory first)"
        )
    if t.layout is not torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; {fn} needs dense (strided) tensors")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {expected}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            f"{fn} treats buffers as flat memory, pass .contiguous() tensors"
        )
    n = t.numel()
    if numel is not None and n != numel:
        raise ValueError(
            f"{name} has {n} elements but {reference} has {numel}; all buffers need the same numel"
        )
    return n


def check_disjoint(buffers: tuple[tuple[str, torch.Tensor], ...], fn: str = "adam_step") -> None:
    """Raise naming two of ``buffers`` that overlap in memory (kernel ``fn`` reads and
    writes them in one pass)."""
    end, previous = 0, ""
    for start, size, name in sorted([(t.data_ptr(), t.nbytes, name) for name, t in buffers]):
        if size:
            if start < end:
                raise ValueError(
                    f"{previous} and {name} overlap in memory; {fn} needs separate "
                    "buffers (it reads and writes them in one pass)"
                )
            end, previous = start + size, name


class FlatBuffers(NamedTuple):
    """The buffers of one flat step after :func:`check_flat_buffers`: the addresses
    and codes the native entry points take (0 for a buffer that is not there)."""

    n: int
    """Elements of every buffer."""
    master: int
    grad: int
    grad_code: int
    states: tuple[int, ...]
    """The state buffers' addresses, in the order they were given."""
    state_code: int
    """Their state format (fp32's when there is no state)."""
    scales: tuple[int, ...]
    """The int8 block-scale buffers' addresses, in the order given; 0 each otherwise."""
    out16: int
    out16_code: int

    def leading_args(self) -> tuple[int, ...]:
        """``param, grad, grad_dtype, <the states>, out16, out_dtype, n``: how
        ``_C.adam.step`` and ``_C.lion.step`` begin (``_C.sgd.step`` orders its own)."""
        return (
            self.master,
            self.grad,
            self.grad_code,
            *self.states,
            self.out16,
            self.out16_code,
            self.n,
        )


def check_flat_buffers(
    fn: str,
    master: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[tuple[str, torch.Tensor]],
    out16: torch.Tensor | None,
    *,
    state_codes: Mapping[torch.dtype, int] = STATE_OF_DTYPE,
    scales: Sequence[tuple[str, torch.Tensor | None]] = (),
    int8_state: str = "an int8 (uint8) state",
) -> FlatBuffers:
    """Check the buffers of one step of kernel ``fn``, each with an error naming it.

    ``master`` is fp32 and sets the element count, ``grad`` is fp32, bf16 or
    fp16. ``states`` are the optimizer's (name, tensor) pairs: the first one's
    dtype is a key of ``state_codes``, every later one has the first one's dtype.
    With an int8 (uint8) state, every buffer of ``scales`` is required (the
    error says it is ``required with {int8_state}``) and holds one fp32 per
    block of ``QBLOCK`` elements. ``out16`` is ``None`` or a bf16/fp16 tensor.
    No two buffers may overlap in memory. The checks run in that order, so
    the first bad argument is the one named.

    The annotations say what a caller should pass; every value is still
    checked (``check_tensor`` raises ``TypeError`` for a non-tensor).
    """
    n = check_tensor("master", master, FP32, None, fn=fn)
    check_tensor("grad", grad, GRAD_DTYPES, n, fn=fn)
    buffers = [("master", master), ("grad", grad)]
    state_ptrs: tuple[int, ...] = ()
    state_code, scale_ptrs = _FP32_STATE, (0,) * len(scales)
    if states:
        first, first_tensor = states[0]
        check_tensor(first, first_tensor, state_codes, n, fn=fn)
        dtype = first_tensor.dtype
        for name, tensor in states[1:]:
            check_tensor(name, tensor, (dtype,), n, first, fn)
        buffers.extend(states)
        state_ptrs = tuple([t.data_ptr() for _, t in states])
        state_code = state_codes[dtype]
        if dtype is torch.uint8:
            blocks = -(-n // QBLOCK)
            ptrs = []
            for name, scale in scales:
                if scale is None:
                    raise ValueError(f"{name} is required with {int8_state}")
                check_tensor(name, scale, FP32, blocks, f"{n} elements in blocks of {QBLOCK}", fn)
                buffers.append((name, scale))
                ptrs.append(scale.data_ptr())
            scale_ptrs = tuple(ptrs)
    out_ptr, out_code = 0, 0
    if out16 is not None:
        check_tensor("out16", out16, OUT16_DTYPES, n, fn=fn)
        buffers.append(("out16", out16))
        out_ptr, out_code = out16.data_ptr(), OUT16_CODES[out16.dtype]
    check_disjoint(tuple(buffers), fn)
    return FlatBuffers(
        n,
        master.data_ptr(),
        grad.data_ptr(),
        GRAD_CODES[grad.dtype],
        state_ptrs,
        state_code,
        scale_ptrs,
        out_ptr,
        out_code,
    )


def finite(
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


def check_step(name: str, step: object) -> int:
    if isinstance(step, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(step).__name__}") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1 (the step count after the increment)")
    return value


def check_rounding(stream: object, offset: object) -> tuple[int, int]:
    """Validated ``round_stream`` (uint64) and ``round_offset`` (int64, >= 0) of a step
    with bf16 state (NOTE [bf16 stochastic rounding] in docs/NOTES.md)."""
    values = []
    for name, value, high in (("round_stream", stream, 2**64), ("round_offset", offset, 2**63)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value < high:
            raise ValueError(f"{name}={value} must be in [0, {high})")
        values.append(value)
    return values[0], values[1]


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
