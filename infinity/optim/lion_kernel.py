"""Low-level fused CPU Lion step over flat buffers (``infinity._C.lion``).

One call updates fp32 master parameters and the momentum in a single pass over
memory, reading gradients in fp32, bf16 or fp16, applying a gradient scale
factor, and optionally writing a bf16/fp16 copy of the updated parameters. The
native kernel is chosen at run time like the Adam kernel's (AVX-512,
AVX2+FMA+F16C or scalar: :func:`infinity.optim.kernels.force_isa` forces both)
and runs on the same pool of C++ threads with the GIL released. Results are
bitwise identical for every ISA and thread count.

Every argument is validated here, with an error that names it
(see NOTE [raw pointers into native code] in docs/NOTES.md).
"""

from __future__ import annotations

import torch

from infinity._native import submodule
from infinity._native.adam import QBLOCK
from infinity.optim.kernel_args import (
    FP32,
    check_disjoint,
    check_flat_buffers,
    check_rounding,
    check_step,
    check_tensor,
    finite,
)

__all__ = ["lion_step", "q8_encode_signed"]


def lion_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    exp_avg_scale: torch.Tensor | None = None,
    step: int = 1,
    round_stream: int = 0,
    round_offset: int = 0,
) -> None:
    """Apply one Lion step in place, in one pass over the buffers.

    Per element, with ``g = grad * grad_scale``::

        p = p * (1 - lr * weight_decay)            # decoupled decay (if weight_decay)
        p = p - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
        out16 = bf16/fp16(p)                       # round-to-nearest-even, if given

    Args:
        master: fp32 master parameters, updated in place.
        grad: gradients, fp32, bf16 or fp16; only read.
        exp_avg: the momentum, updated in place: fp32, bf16 (rounded
            stochastically on every store, as Adam's moments), or uint8 int8
            codes with one fp32 scale per 256 elements in ``exp_avg_scale``
            (the Adam kernel's signed codes, ``cpp/simd/q8_codec.hpp``). The
            update itself runs in fp32.
        lr, beta1, beta2, weight_decay: as in the Lion paper (and ``lion_pytorch``).
        grad_scale: factor applied to every gradient before the update.
        out16: optional bf16/fp16 buffer that receives the updated parameters.
        step, round_stream, round_offset: draw the random bits of a bf16
            momentum's rounding, as for :func:`infinity.optim.kernels.adam_step`
            (Lion's update itself does not depend on the step).

    All buffers must be contiguous CPU tensors with the same number of
    elements that do not overlap.

    Raises:
        TypeError: a buffer is not a tensor or has the wrong dtype, or a
            hyper-parameter has the wrong type.
        ValueError: wrong device, layout, contiguity or size, overlapping
            buffers, or a hyper-parameter out of range.
    """
    b = check_flat_buffers(
        "lion_step",
        master,
        grad,
        (("exp_avg", exp_avg),),
        out16,
        scales=(("exp_avg_scale", exp_avg_scale),),
        int8_state="an int8 (uint8) momentum",
    )
    submodule("lion").step(
        *b.leading_args(),
        finite("lr", lr, low=0.0),
        finite("beta1", beta1, low=0.0, high=1.0),
        finite("beta2", beta2, low=0.0, high=1.0),
        finite("weight_decay", weight_decay, low=0.0),
        finite("grad_scale", grad_scale),
        b.state_code,
        *b.scales,
        check_step("step", step),
        *check_rounding(round_stream, round_offset),
    )


def q8_encode_signed(values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor) -> None:
    """Store fp32 ``values`` as the kernel stores an int8 momentum: uint8 ``code`` and
    fp32 ``scale`` per block of 256 elements, blocks from element 0."""
    n = check_tensor("values", values, FP32, None, fn="q8_encode_signed")
    check_tensor("code", code, (torch.uint8,), n, "values", "q8_encode_signed")
    check_tensor("scale", scale, FP32, -(-n // QBLOCK), f"{n} values in blocks", "q8_encode_signed")
    check_disjoint((("values", values), ("code", code), ("scale", scale)), "q8_encode_signed")
    submodule("lion").q8_encode_signed(values.data_ptr(), code.data_ptr(), scale.data_ptr(), n)
