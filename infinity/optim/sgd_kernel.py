"""Low-level fused CPU SGD step over flat buffers (``infinity._C.sgd``).

One call updates fp32 master parameters and the momentum buffer in a single
pass over memory, reading gradients in fp32, bf16 or fp16, applying a gradient
scale factor, and optionally writing a bf16/fp16 copy of the updated
parameters. The native kernel is chosen at run time like the Adam and Lion
kernels (AVX-512, AVX2+FMA+F16C or scalar:
:func:`infinity.optim.kernels.force_isa` forces all) and runs on the same pool
of C++ threads with the GIL released. Results are bitwise identical for every
ISA and thread count, and on fp32 buffers to ``torch.optim.SGD(foreach=False)``
on a CPU whose torch kernels use FMA (AVX2 or AVX-512).

Every argument is validated here, with an error that names it
(see NOTE [raw pointers into native code] in docs/NOTES.md).
"""

from __future__ import annotations

import torch

from infinity._native import submodule
from infinity.optim.kernel_args import STATE_OF_DTYPE, check_flat_buffers, finite

__all__ = ["sgd_step"]

# The momentum buffer is fp32 or bf16 (no int8 format).
_STATE_OF_DTYPE = {d: code for d, code in STATE_OF_DTYPE.items() if d is not torch.uint8}


def sgd_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
) -> None:
    """Apply one ``torch.optim.SGD`` step in place, in one pass over the buffers.

    Per element, with ``g = grad * grad_scale`` (negated if ``maximize``)::

        g = g + weight_decay * p                       # if weight_decay
        buf = g                                        # first_step (momentum != 0)
        buf = momentum * buf + (1 - dampening) * g     # later steps (momentum != 0)
        g = g + momentum * buf if nesterov else buf    # momentum != 0
        p = p - lr * g
        out16 = bf16/fp16(p)                           # round-to-nearest-even, if given

    Args:
        master: fp32 master parameters, updated in place.
        grad: gradients, fp32, bf16 or fp16; only read.
        momentum_buffer: fp32 or bf16 (rounded to nearest even on every store;
            the step uses the fp32 value), updated in place; required when
            ``momentum != 0``, ignored (may be ``None``) when it is 0.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as in
            ``torch.optim.SGD``.
        first_step: the buffer's first step: it is set to the gradient (torch's
            ``momentum_buffer`` is ``None`` before), dampening not applied.
        grad_scale: factor applied to every gradient before the update.
        out16: optional bf16/fp16 buffer that receives the updated parameters.

    All buffers must be contiguous CPU tensors with the same number of
    elements that do not overlap.

    Raises:
        TypeError: a buffer is not a tensor or has the wrong dtype, or a
            hyper-parameter has the wrong type.
        ValueError: wrong device, layout, contiguity or size, overlapping
            buffers, a missing momentum buffer, or a hyper-parameter out of range.
    """
    # The momentum is checked first: whether the buffer is used depends on it.
    momentum = finite("momentum", momentum, low=0.0)
    states: tuple[tuple[str, torch.Tensor], ...] = ()
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(f"momentum_buffer is required with momentum={momentum} (!= 0)")
        states = (("momentum_buffer", momentum_buffer),)
    b = check_flat_buffers("sgd_step", master, grad, states, out16, state_codes=_STATE_OF_DTYPE)
    submodule("sgd").step(
        b.master,
        b.grad,
        b.grad_code,
        b.states[0] if b.states else 0,
        b.state_code,
        b.out16,
        b.out16_code,
        b.n,
        finite("lr", lr, low=0.0),
        momentum,
        finite("dampening", dampening),
        finite("weight_decay", weight_decay, low=0.0),
        _flag("nesterov", nesterov),
        _flag("maximize", maximize),
        _flag("first_step", first_step),
        finite("grad_scale", grad_scale),
    )


def _flag(name: str, value: object) -> bool:
    """``value`` if it is a bool; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
