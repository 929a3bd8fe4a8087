"""``infinity.optim.CPUSGD``: ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight
decay, maximize) for CPU tensors and offloaded models, with its fused kernel's entry point
(:func:`sgd_step`, ``infinity._C.sgd``).

It is the smallest optimizer on the generic front-end and shows the whole recipe
(docs/design/optimizer.md, "Adding an optimizer"): validated hyper-parameters of a
param group (:class:`SGDHyperParams`), the per-element update over a run of
tensors inside a chunk and its state slot (:class:`SGDChunks`: one
``momentum_buffer``, as torch names it), the front-end users construct
(:class:`CPUSGD`), and the Python side of its native kernel (:func:`sgd_step`,
``cpp/sgd/``).

One :func:`sgd_step` does torch's single-tensor SGD operation for operation in
one pass over memory: it updates the fp32 master parameters and the momentum
buffer, reading gradients in fp32, bf16 or fp16, applying a gradient scale
factor, and optionally writing a bf16/fp16 copy of the updated parameters. The
kernel is chosen at run time like the Adam and Lion kernels (AVX-512,
AVX2+FMA+F16C or scalar: :func:`infinity.optim.kernels.force_isa` forces all)
and runs on the same pool of C++ threads with the GIL released. Results are
bitwise identical for every ISA and thread count, and on fp32 buffers to
``torch.optim.SGD(foreach=False)`` on a CPU whose torch kernels use FMA (AVX2
or AVX-512). Every argument is validated here, with an error that names it
(see NOTE [raw pointers into native code] in docs/NOTES.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity._native import submodule
from infinity.optim.chunk_optimizer import (
    ChunkOptimizer,
    StepViews,
    hyper_value,
)
from infinity.optim.device_state import BlockStates, device_blocks
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.kernel_args import STATE_OF_DTYPE, check_bool, check_flat_buffers, finite

__all__ = ["CPUSGD", "SGD", "SGDChunks", "SGDHyperParams", "sgd_on_device", "sgd_step"]

# The momentum buffer is fp32 or bf16 (no int8 format).
_STATE_OF_DTYPE = {d: code for d, code in STATE_OF_DTYPE.items() if d is not torch.uint8}

# Flags torch.optim.SGD keeps in every group that CPUSGD does not implement: flag -> instead.
_UNSUPPORTED_FLAGS = {
    "differentiable": "torch.optim.SGD(differentiable=True)",
    "fused": "torch.optim.SGD(fused=True) on the GPU",
}


@dataclass(frozen=True)
class SGDHyperParams:
    """The hyper-parameters of one param group, as plain validated floats."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> SGDHyperParams:
        """Read and validate a param group; ``ValueError`` naming the key otherwise."""
        for flag, instead in _UNSUPPORTED_FLAGS.items():
            if group.get(flag, False):
                raise ValueError(f"CPUSGD does not implement {flag}=True; use {instead}")
        hyper = cls(
            lr=hyper_value("lr", group["lr"], low=0.0),
            momentum=hyper_value("momentum", group["momentum"], low=0.0),
            dampening=hyper_value("dampening", group["dampening"], low=-math.inf),
            weight_decay=hyper_value("weight_decay", group["weight_decay"], low=0.0),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )
        if hyper.nesterov and (hyper.momentum <= 0 or hyper.dampening != 0):
            raise ValueError(
                f"nesterov=True needs momentum > 0 and dampening == 0 (got momentum="
                f"{hyper.momentum}, dampening={hyper.dampening}), as in torch.optim.SGD"
            )
        return hyper


class SGDChunks(ChunkOptimizer[SGDHyperParams]):
    """SGD over chunks: one state slot, the momentum buffer (fp32 or bf16), updated
    by the fused kernel in torch's order."""

    name = "sgd"
    front_end = "infinity.optim.CPUSGD"
    state_slots = ("momentum_buffer",)
    state_dtypes = ("fp32", "bf16")
    device_temporaries = 2  # sgd_on_device: the scaled gradient and add_'s scaled term

    def step(
        self, views: StepViews, hyper: SGDHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One SGD update of the run (see :func:`sgd_step`)."""
        if views.master.device.type != "cpu":
            sgd_on_device(views, hyper, first_step=step == 1, grad_scale=grad_scale)
            return
        sgd_step(
            views.master,
            views.grad,
            views.state["momentum_buffer"],
            lr=hyper.lr,
            momentum=hyper.momentum,
            dampening=hyper.dampening,
            weight_decay=hyper.weight_decay,
            nesterov=hyper.nesterov,
            maximize=hyper.maximize,
            first_step=step == 1,  # torch starts the buffer as the gradient itself
            grad_scale=grad_scale,
            out16=views.out16,
        )


def sgd_on_device(
    views: StepViews, hyper: SGDHyperParams, *, first_step: bool, grad_scale: float
) -> None:
    """:func:`sgd_step`'s update (an fp32 or bf16 buffer, rounded to nearest as the host
    kernel rounds it) as device kernels, on views in device memory, block by block
    (NOTE [chunks homed on the device])."""
    master, grad = views.master, views.grad
    scale = -grad_scale if hyper.maximize else grad_scale
    for part in device_blocks(master.numel()):
        p, g = master[part], grad[part].to(torch.float32, copy=True)
        if scale != 1.0:
            g.mul_(scale)
        if hyper.weight_decay:
            g.add_(p, alpha=hyper.weight_decay)
        if hyper.momentum:
            states = BlockStates(views.state, part)  # bf16: to nearest, no bits
            buf = states.load("momentum_buffer")
            if first_step:
                buf.copy_(g)
            else:
                buf.mul_(hyper.momentum).add_(g, alpha=1.0 - hyper.dampening)
            states.store("momentum_buffer", buf)
            if hyper.nesterov:
                g.add_(buf, alpha=hyper.momentum)
            else:
                g = buf
        p.add_(g, alpha=-hyper.lr)
        if views.out16 is not None:
            views.out16[part].copy_(p)


SGD = SGDChunks()
"""SGD with an fp32 momentum buffer; ``SGD.with_state_dtype("bf16")`` for bf16."""


class CPUSGD(CPUOptimizer[SGDHyperParams]):
    """``torch.optim.SGD`` for CPU fp32 tensors and offloaded parameters.

    Same signature, defaults, param-group keys and per-parameter state
    (``momentum_buffer``, plus the ``step`` count every infinity optimizer
    keeps) as ``torch.optim.SGD``; results match its single-tensor path.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate (a float or a 1-element tensor).
        momentum: momentum factor (0: plain SGD; the buffer still has a slot in
            offloaded chunks, where it stays zero).
        dampening: dampening of the momentum (not with ``nesterov``).
        weight_decay: L2 penalty, ``grad += weight_decay * p``.
        nesterov: Nesterov momentum.
        maximize: follow the gradient up instead of down.
        foreach: accepted and ignored (the update runs per chunk or per tensor).
        differentiable, fused: accepted for signature compatibility; ``True`` raises.
    """

    hyper_params = SGDHyperParams
    chunk_optimizer = SGD

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        super().__init__(params, defaults)


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
        check_bool("nesterov", nesterov),
        check_bool("maximize", maximize),
        check_bool("first_step", first_step),
        finite("grad_scale", grad_scale),
    )
