"""The chunk-optimizer interface: what the planner, the offloaded step and the
checkpoint format ask of an optimizer instead of assuming Adam.

An optimizer keeps, per trainable chunk, one fp32 *unit*: the fp32 master
copy of the parameters (16-bit compute dtypes only; for fp32 the parameter
chunk is the master) followed by one chunk-long fp32 tensor per *state slot*
(Adam: ``exp_avg`` then ``exp_avg_sq``). The planner sizes a unit from
:meth:`ChunkOptimizer.unit_parts`, the step and the checkpoint cut it with
:meth:`ChunkOptimizer.unit_views`, and :meth:`ChunkOptimizer.step` runs the
update on one run of tensors. A second optimizer (SGD with momentum: one slot)
is a subclass naming its slots and its kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from infinity.optim import kernels
from infinity.optim.hyper import AdamHyperParams

H = TypeVar("H", contravariant=True)


@dataclass(frozen=True)
class StepViews:
    """Flat, equally long views of one run of tensors inside a chunk."""

    master: torch.Tensor  # fp32 values updated in place (the parameters, for fp32)
    grad: torch.Tensor  # gradients in the compute dtype
    state: Mapping[str, torch.Tensor]  # fp32, one view per state slot
    out16: torch.Tensor | None  # 16-bit parameters rewritten from ``master``, if any


@dataclass(frozen=True)
class UnitViews:
    """One chunk's optimizer unit, cut into its parts (each ``capacity`` elements)."""

    master: torch.Tensor | None  # None for fp32 (the parameter chunk is the master)
    state: dict[str, torch.Tensor]  # slot name -> fp32 view, in slot order

    def span(self, span: slice) -> dict[str, torch.Tensor]:
        """The state views of elements ``span``."""
        return {name: view[span] for name, view in self.state.items()}


class ChunkOptimizer(ABC, Generic[H]):
    """An optimizer whose per-element state is fp32 tensors shaped like the parameters."""

    name: ClassVar[str]
    state_slots: ClassVar[tuple[str, ...]]  # names of the fp32 state tensors, in unit order

    def unit_parts(self, has_master: bool) -> int:
        """Chunk-long fp32 parts of one unit: the master (if any) plus one per slot."""
        return len(self.state_slots) + int(has_master)

    def unit_views(self, unit: torch.Tensor, capacity: int, has_master: bool) -> UnitViews:
        """Cut a flat fp32 ``unit`` of a chunk of ``capacity`` elements into its parts."""
        parts = [
            unit[k * capacity : (k + 1) * capacity] for k in range(self.unit_parts(has_master))
        ]
        master = parts.pop(0) if has_master else None
        return UnitViews(master, dict(zip(self.state_slots, parts, strict=True)))

    @abstractmethod
    def step(self, views: StepViews, hyper: H, *, step: int, grad_scale: float) -> None:
        """Update one run of tensors in place; ``step`` is their step count after it
        (1 on the first update), gradients are divided by ``grad_scale``."""


class AdamChunks(ChunkOptimizer[AdamHyperParams]):
    """Adam / AdamW over chunks, on the fused CPU-Adam kernel (:func:`.kernels.adam_step`)."""

    name = "adam"
    state_slots = ("exp_avg", "exp_avg_sq")

    def step(
        self, views: StepViews, hyper: AdamHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One Adam update of the run (see :class:`ChunkOptimizer`)."""
        kernels.adam_step(
            views.master,
            views.grad,
            views.state["exp_avg"],
            views.state["exp_avg_sq"],
            step=step,
            grad_scale=grad_scale,
            out16=views.out16,
            **hyper.kernel_kwargs(),
        )


ADAM = AdamChunks()
