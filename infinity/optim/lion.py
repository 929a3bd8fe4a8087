"""``infinity.optim.CPULion``: the Lion optimizer (Chen et al. 2023) for CPU tensors and
offloaded models, with its fused kernel's entry points (:func:`lion_step`, ``infinity._C.lion``).

Lion keeps one state tensor per parameter, the momentum ``exp_avg`` (Adam keeps
two), and moves every weight by ``lr`` times the sign of an interpolation of
momentum and gradient. With states on NVMe it moves half of Adam's moment
bytes across the disk every step. ``Config(optimizer_state_dtype="bf16" |
"int8")`` stores the momentum in bf16 or as the int8 codes of the Adam
kernel's first moment.

One :func:`lion_step` updates fp32 master parameters and the momentum in a
single pass over memory, reading gradients in fp32, bf16 or fp16, applying a
gradient scale factor, and optionally writing a bf16/fp16 copy of the updated
parameters. The native kernel is chosen at run time like the Adam kernel's
(AVX-512, AVX2+FMA+F16C or scalar: :func:`infinity.optim.kernels.force_isa`
forces every kernel) and runs on the same pool of C++ threads with the GIL released.
Results are bitwise identical for every ISA and thread count. Every argument
is validated here, with an error that names it
(see NOTE [raw pointers into native code] in docs/NOTES.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity._native import submodule
from infinity._native.adam import QBLOCK
from infinity.optim.chunk_optimizer import (
    ChunkOptimizer,
    StepViews,
    UnitViews,
    betas_value,
    hyper_value,
    read_slot,
)
from infinity.optim.device_state import BlockStates, device_blocks
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.kernel_args import (
    FP32,
    check_disjoint,
    check_flat_buffers,
    check_rounding,
    check_step,
    check_tensor,
    finite,
)

__all__ = [
    "LION",
    "CPULion",
    "LionChunks",
    "LionHyperParams",
    "lion_on_device",
    "lion_step",
    "q8_encode_signed",
]


@dataclass(frozen=True)
class LionHyperParams:
    """The hyper-parameters of one param group, as plain validated floats."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> LionHyperParams:
        """Read and validate a param group; ``ValueError`` naming the key otherwise."""
        beta1, beta2 = betas_value(group)
        return cls(
            lr=hyper_value("lr", group["lr"], low=0.0),
            beta1=beta1,
            beta2=beta2,
            weight_decay=hyper_value("weight_decay", group["weight_decay"], low=0.0),
        )


class LionChunks(ChunkOptimizer[LionHyperParams]):
    """Lion over chunks: one state slot, the momentum ``exp_avg``, in any state format."""

    name = "lion"
    front_end = "infinity.optim.CPULion"
    state_slots = ("exp_avg",)
    state_dtypes = ("fp32", "bf16", "int8")
    # lion_on_device: a scaled gradient, the interpolation and add_'s scaled term (measured)
    device_temporaries = 3
    device_rounding = True

    def read_state(self, unit: UnitViews, span: slice) -> dict[str, torch.Tensor]:
        """A new fp32 copy of the momentum of elements ``span`` (int8: decoded)."""
        return {"exp_avg": read_slot(unit.slots["exp_avg"].span(span), signed=True)}

    def write_state(self, unit: UnitViews, span: slice, values: Mapping[str, torch.Tensor]) -> None:
        """Store an fp32 momentum as the kernel would (int8: encoded block by block from
        ``span.start``, a block boundary: tensors start on one)."""
        slot = unit.slots["exp_avg"].span(span)
        value = values["exp_avg"].reshape(-1)
        if slot.scale is None:
            slot.data.copy_(value)
        else:
            q8_encode_signed(value.to(torch.float32).contiguous(), slot.data, slot.scale)

    def step(
        self, views: StepViews, hyper: LionHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One Lion update of the run (see :func:`lion_step`)."""
        if views.master.device.type != "cpu":
            lion_on_device(views, hyper, step=step, grad_scale=grad_scale)
            return
        lion_step(
            views.master,
            views.grad,
            views.state["exp_avg"],
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            weight_decay=hyper.weight_decay,
            grad_scale=grad_scale,
            out16=views.out16,
            exp_avg_scale=views.scales.get("exp_avg"),
            step=step,
            round_stream=views.rounding[0],
            round_offset=views.rounding[1],
        )


LION = LionChunks()
"""Lion with an fp32 momentum; ``LION.with_state_dtype(...)`` for bf16 or int8."""


class CPULion(CPUOptimizer[LionHyperParams]):
    """Lion for CPU fp32 tensors and offloaded parameters, fused and vectorized.

    The update of the paper and of ``lion_pytorch.Lion`` (decoupled weight
    decay ``p *= 1 - lr * weight_decay``, then ``p -= lr * sign(beta1 * m +
    (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``), with its
    signature and defaults. Lion's updates have the magnitude of ``lr`` in every
    coordinate: the paper uses a learning rate 3-10x smaller than AdamW's and a
    weight decay 3-10x larger.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate (a float or a 1-element tensor).
        betas: interpolation of the update direction and decay of the momentum.
        weight_decay: decoupled weight decay.

    Per-parameter state: ``step`` and ``exp_avg`` (fp32 in ``state_dict()``
    whatever the stored format).
    """

    hyper_params = LionHyperParams
    chunk_optimizer = LION

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults)


def lion_on_device(
    views: StepViews, hyper: LionHyperParams, *, step: int, grad_scale: float
) -> None:
    """:func:`lion_step`'s update (the momentum stored as the host kernel stores it, in
    any format) as device kernels, on views in device memory, block by block
    (NOTE [chunks homed on the device])."""
    master, grad = views.master, views.grad
    for part in device_blocks(master.numel()):
        states = BlockStates(
            views.state, part, scales=views.scales, rounding=views.rounding, step=step
        )
        m = states.load("exp_avg")
        p, g = master[part], grad[part].to(torch.float32, copy=True)
        if grad_scale != 1.0:
            g.mul_(grad_scale)
        if hyper.weight_decay:
            p.mul_(1.0 - hyper.lr * hyper.weight_decay)
        direction = m.mul(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1)
        p.add_(direction.sign_(), alpha=-hyper.lr)
        m.mul_(hyper.beta2).add_(g, alpha=1.0 - hyper.beta2)
        states.store("exp_avg", m, stochastic=0)
        if views.out16 is not None:
            views.out16[part].copy_(p)


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
