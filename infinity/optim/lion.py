"""``infinity.optim.CPULion``: the Lion optimizer (Chen et al. 2023) for CPU tensors and
offloaded models, on a fused native kernel (:mod:`infinity.optim.lion_kernel`).

Lion keeps one state tensor per parameter, the momentum ``exp_avg`` (Adam keeps
two), and moves every weight by ``lr`` times the sign of an interpolation of
momentum and gradient. With states on NVMe it moves half of Adam's moment
bytes across the disk every step. ``Config(optimizer_state_dtype="bf16" |
"int8")`` stores the momentum in bf16 or as the int8 codes of the Adam
kernel's first moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim.chunk_optimizer import (
    ChunkOptimizer,
    StepViews,
    UnitViews,
    betas_value,
    hyper_value,
)
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.lion_kernel import lion_step, q8_encode_signed
from infinity.optim.state_formats import read_slot

__all__ = ["LION", "CPULion", "LionChunks", "LionHyperParams"]


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
        """One Lion update of the run (see :func:`~infinity.optim.lion_kernel.lion_step`)."""
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

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def hyper_of(self, group: dict[str, Any]) -> LionHyperParams:
        """The validated Lion hyper-parameters of one param group."""
        return LionHyperParams.from_group(group)

    def make_chunk_optimizer(self) -> ChunkOptimizer[LionHyperParams]:
        """The fused Lion kernel over the ``exp_avg`` slot."""
        return LION
