"""``infinity.optim.CPUSGD``: ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight
decay, maximize) for CPU tensors and offloaded models, in this module and its fused
kernel (:mod:`infinity.optim.sgd_kernel`).

It is the smallest optimizer on the generic front-end and shows the whole recipe
(docs/design/optimizer.md, "Adding an optimizer"): validated hyper-parameters of a
param group (:class:`SGDHyperParams`), the per-element update over a run of
tensors inside a chunk and its state slot (:class:`SGDChunks`: one
``momentum_buffer``, as torch names it), and the front-end users construct
(:class:`CPUSGD`). The update runs on a fused native kernel
(:mod:`infinity.optim.sgd_kernel`, ``cpp/sgd/``) that does torch's single-tensor
SGD operation for operation, so results match ``torch.optim.SGD(foreach=False)``
bit for bit on fp32 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews, hyper_value
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.sgd_kernel import sgd_step

__all__ = ["CPUSGD", "SGD", "SGDChunks", "SGDHyperParams"]

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

    def step(
        self, views: StepViews, hyper: SGDHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One SGD update of the run (see :func:`~infinity.optim.sgd_kernel.sgd_step`)."""
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

    def hyper_of(self, group: dict[str, Any]) -> SGDHyperParams:
        """The validated SGD hyper-parameters of one param group."""
        return SGDHyperParams.from_group(group)

    def make_chunk_optimizer(self) -> ChunkOptimizer[SGDHyperParams]:
        """SGD over the ``momentum_buffer`` slot."""
        return SGD
